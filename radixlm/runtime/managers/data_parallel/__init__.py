"""The data-parallel controller: replicas and the cache-aware load balancer in front of them."""

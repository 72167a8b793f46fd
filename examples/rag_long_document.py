"""RAG over a long document: many questions about one document, each program starting
with the same long context. run_batch caches the context once, so the cache hit rate
is high; compare it with --no-precache."""

import argparse

import radixlm as sgl

DOCUMENT = " ".join(
    f"Section {i}. The radix tree stores token sequences and shares their common prefixes; "
    f"entry {i} describes eviction, locking and page size {2 ** (i % 5)}."
    for i in range(40)
)


@sgl.function
def answer(s, question):
    s += sgl.system("Answer questions using only this document:\n" + DOCUMENT)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="radixlm/SGLang server (default: in-process Engine)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine(max_total_tokens=16384)
    sgl.set_default_backend(backend)

    questions = [f"What does section {i} say about page size?" for i in range(16)]
    sgl.flush_cache()
    states = answer.run_batch([{"question": q} for q in questions], temperature=0)
    prompt = sum(s.get_meta_info("answer")["prompt_tokens"] for s in states)
    cached = sum(s.get_meta_info("answer")["cached_tokens"] for s in states)
    print(f"{len(states)} questions, {prompt} prompt tokens, {cached} served from the cache")
    print(f"cache hit rate (these requests): {cached / prompt:.1%}")
    print(f"cache hit rate (server): {sgl.get_server_info()['cache_hit_rate']:.1%}")
    print("first answer:", repr(states[0]["answer"]))
    backend.shutdown()


if __name__ == "__main__":
    main()

"""Fork/join: three drafts written in parallel from one shared prefix, which the runtime
caches once before the branches start (each branch reports it as cached)."""

import argparse

import radixlm as sgl


@sgl.function
def drafts(s, topic, num_drafts):
    s += sgl.system("You write short, vivid product descriptions.")
    s += sgl.user(f"Write a description of {topic}.")
    forks = s.fork(num_drafts)
    forks += lambda i: sgl.assistant(sgl.gen("draft", max_tokens=16, temperature=0.8))
    forks.join()
    s += sgl.user("Which draft is best?") + sgl.assistant(sgl.gen("verdict", max_tokens=12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="radixlm/SGLang server (default: in-process Engine)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine(max_total_tokens=16384)
    sgl.set_default_backend(backend)

    state = drafts.run(topic="a solar-powered kettle", num_drafts=3)
    for i, (text, meta) in enumerate(zip(state["draft"], state.get_meta_info("draft"))):
        print(
            f"draft {i}: {text!r}  (prompt {meta['prompt_tokens']}, cached {meta['cached_tokens']})"
        )
    print("verdict:", repr(state["verdict"]))
    backend.shutdown()


if __name__ == "__main__":
    main()

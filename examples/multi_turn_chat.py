"""Multi-turn chat: each turn re-sends the conversation, and the radix cache serves the
earlier turns from KV already computed (watch cached_tokens grow)."""

import argparse

import radixlm as sgl


@sgl.function
def chat(s, turns):
    s += sgl.system("You are a friendly travel agent.")
    for i, question in enumerate(turns):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="radixlm/SGLang server (default: in-process Engine)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine(max_total_tokens=16384)
    sgl.set_default_backend(backend)

    turns = ["I want to visit Italy.", "What should I see in Rome?", "And where should I eat?"]
    state = chat.run(turns=turns, temperature=0)
    for i, question in enumerate(turns):
        meta = state.get_meta_info(f"answer_{i}")
        print(
            f"user: {question}\nassistant: {state[f'answer_{i}']!r}  "
            f"(prompt {meta['prompt_tokens']}, cached {meta['cached_tokens']})"
        )
    backend.shutdown()


if __name__ == "__main__":
    main()

"""Quickstart: one @function program with roles and gen, on the in-process Engine.

python examples/quickstart.py                 # built-in tiny model, in-process
python examples/quickstart.py --url http://127.0.0.1:30000   # a running server
"""

import argparse

import radixlm as sgl


@sgl.function
def qa(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=24))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="radixlm/SGLang server (default: in-process Engine)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine(max_total_tokens=16384)
    sgl.set_default_backend(backend)

    state = qa.run(question="What is the capital of France?", temperature=0)
    print("answer:", repr(state["answer"]))
    print("meta:", state.get_meta_info("answer"))
    for m in state.messages():
        print(f"  {m['role']:>9}: {m['content']!r}")
    backend.shutdown()


if __name__ == "__main__":
    main()

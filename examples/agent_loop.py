"""An agent loop: a long tool-description prefix shared by every step; each step selects
a tool, writes its argument, and reads a (fake) observation. The prefix is computed once
and served from the radix cache at every later step."""

import argparse

import radixlm as sgl

TOOLS = {
    "search": "search(query): look a query up on the web and return the top snippet.",
    "calculator": "calculator(expression): evaluate an arithmetic expression.",
    "finish": "finish(answer): return the final answer to the user.",
}
TOOL_PREFIX = "You are an agent. You may call these tools:\n" + "\n".join(
    f"- {desc} " + "Use it carefully and only when it helps. " * 6 for desc in TOOLS.values()
)


def fake_tool(name: str, argument: str) -> str:
    return {"search": "Paris is the capital of France.", "calculator": "42"}.get(name, "done")


@sgl.function
def agent(s, task, max_steps):
    s += sgl.system(TOOL_PREFIX)
    s += sgl.user(task)
    for step in range(max_steps):
        s += sgl.assistant_begin()
        s += "Tool: " + sgl.select(f"tool_{step}", choices=list(TOOLS))
        s += "\nArgument: " + sgl.gen(f"arg_{step}", max_tokens=8, stop="\n")
        s += sgl.assistant_end()
        if s[f"tool_{step}"] == "finish":
            break
        s += sgl.user("Observation: " + fake_tool(s[f"tool_{step}"], s[f"arg_{step}"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="radixlm/SGLang server (default: in-process Engine)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine(max_total_tokens=16384)
    sgl.set_default_backend(backend)

    state = agent.run(task="What is the capital of France?", max_steps=3, temperature=0)
    step = 0
    while f"tool_{step}" in state:
        meta = state.get_meta_info(f"arg_{step}")
        print(
            f"step {step}: {state[f'tool_{step}']}({state[f'arg_{step}']!r})  "
            f"prompt {meta['prompt_tokens']} tokens, cached {meta['cached_tokens']}"
        )
        step += 1
    backend.shutdown()


if __name__ == "__main__":
    main()

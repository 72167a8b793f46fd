"""JSON extraction with a schema: gen(json_schema=...) constrains decoding so the output
parses and validates; gen_int shows a dtype constraint."""

import argparse
import json

import radixlm as sgl

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "city": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "city"],
    "additionalProperties": False,
}


@sgl.function
def extract(s, text):
    s += sgl.system("Extract the person's name and city as JSON.")
    s += sgl.user(text)
    s += sgl.assistant(sgl.gen("json", max_tokens=48, json_schema=SCHEMA))
    s += sgl.user("How old are they?") + sgl.assistant(sgl.gen_int("age", max_tokens=4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="radixlm/SGLang server (default: in-process Engine)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine(max_total_tokens=16384)
    sgl.set_default_backend(backend)

    state = extract.run(text="Ada Lovelace, 36, lives in London.", temperature=0)
    print("raw:", repr(state["json"]))
    try:
        print("parsed:", json.loads(state["json"]))
    except json.JSONDecodeError as e:
        print("did not parse (is constrained decoding enabled in this runtime?):", e)
    print("age:", repr(state["age"]))
    backend.shutdown()


if __name__ == "__main__":
    main()

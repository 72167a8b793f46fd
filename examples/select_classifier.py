"""A select() classifier: the label is picked from the logprobs of each choice after a
shared prefix, scored in one batched request; run_batch classifies many tickets."""

import argparse

import radixlm as sgl

TEAMS = ["billing", "shipping", "technical"]


@sgl.function
def triage(s, ticket):
    s += sgl.system("You route support tickets to a team: " + ", ".join(TEAMS) + ".")
    s += sgl.user(ticket)
    s += sgl.assistant(sgl.select("team", choices=TEAMS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="radixlm/SGLang server (default: in-process Engine)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine(max_total_tokens=16384)
    sgl.set_default_backend(backend)

    tickets = [
        "My parcel never arrived",
        "I was charged twice",
        "The app crashes on login",
        "Where is my refund?",
        "The tracking number does not work",
    ]
    states = triage.run_batch([{"ticket": t} for t in tickets], progress_bar=True)
    for ticket, state in zip(tickets, states):
        scores = state.get_meta_info("team")["normalized_prompt_logprobs"]
        print(
            f"{ticket!r:40} -> {state['team']:10} {dict(zip(TEAMS, (round(x, 2) for x in scores)))}"
        )
    backend.shutdown()


if __name__ == "__main__":
    main()

"""SGLang's ``--speculative-*`` flags, declared and validated once for both entry points.

Why a module of its own: the offline ``generate`` and ``launch_server`` take the same flags
and must refuse the same values with the same words (what this runtime cannot honour:
tree drafts, a Q other than S + 1, more draft steps than the MTP layer chains, a
checkpoint without its MTP layer). Each entry point reports a refusal as its own error
type (generate's ``InputError``, the server's ``ServerArgError``), passed as ``error``.
It imports no torch, so the server's flag parsing stays light.
"""

from __future__ import annotations

import argparse
from typing import Any

ErrorType = type[ValueError]

# The NextN layer chained on itself: deeper drafts rarely pay off (runtime/speculative.py).
MAX_DRAFT_TOKENS = 3
# SGLang's names for the chain draft of the checkpoint's MTP layer (SGLang maps NEXTN to
# EAGLE); reported as NEXTN.
SPECULATIVE_ALGORITHMS = ("NEXTN", "EAGLE")
SPECULATIVE_FLAGS = (
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
)


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    """The four flags, as one argument group with their help."""
    spec = p.add_argument_group("MTP speculative decoding (SGLang's flags)")
    spec.add_argument(
        "--speculative-algorithm",
        choices=SPECULATIVE_ALGORITHMS,
        default=None,
        help="NEXTN: the checkpoint's MTP layer drafts, the model verifies (EAGLE: an alias)",
    )
    spec.add_argument(
        "--speculative-num-steps",
        type=int,
        default=None,
        metavar="S",
        help=f"S, draft tokens per round, 1 to {MAX_DRAFT_TOKENS} (default 1)",
    )
    spec.add_argument(
        "--speculative-eagle-topk",
        type=int,
        default=None,
        metavar="K",
        help="drafts per step: 1 only (one chain; tree drafts are not supported)",
    )
    spec.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        metavar="Q",
        help="Q, tokens verified per round: S + 1 only (the default; a chain draft's size)",
    )


def speculative_steps(args: Any, error: ErrorType = ValueError) -> int | None:
    """S, the draft tokens per round, when ``args.speculative_algorithm`` is given (else
    None); the SGLang flags this runtime cannot honour are refused with the value to use.
    ``args``: anything with the four flags' attributes (a Namespace, ServerArgs)."""
    if args.speculative_algorithm is None:
        for name in SPECULATIVE_FLAGS:
            if getattr(args, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise error(f"{flag} needs --speculative-algorithm NEXTN (or EAGLE)")
        return None
    if args.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
        raise error(
            f"--speculative-algorithm {args.speculative_algorithm}: only NEXTN (or its alias "
            "EAGLE), the checkpoint's MTP layer as the draft, is supported"
        )
    steps = 1 if args.speculative_num_steps is None else args.speculative_num_steps
    if not 1 <= steps <= MAX_DRAFT_TOKENS:
        raise error(
            f"--speculative-num-steps {steps}: the MTP layer drafts 1 to {MAX_DRAFT_TOKENS} "
            f"tokens per round; use --speculative-num-steps 1 to {MAX_DRAFT_TOKENS}"
        )
    topk = args.speculative_eagle_topk
    if topk is not None and topk != 1:
        raise error(
            f"--speculative-eagle-topk {topk}: tree drafts are not supported, only one "
            "draft chain per request; use --speculative-eagle-topk 1 or leave it out"
        )
    draft_tokens = args.speculative_num_draft_tokens
    if draft_tokens is not None and draft_tokens != steps + 1:
        raise error(
            f"--speculative-num-draft-tokens {draft_tokens}: Q must be S + 1 for a chain "
            f"draft (--speculative-num-steps {steps}); use --speculative-num-draft-tokens "
            f"{steps + 1} or leave it out"
        )
    return steps


def check_nextn_layer(
    nextn_layers: int, algorithm: str, model_path: str, error: ErrorType = ValueError
) -> None:
    """Refuse speculation on a checkpoint without its MTP (NextN) layer
    (``num_nextn_predict_layers`` in its config.json), before anything is sized."""
    if nextn_layers < 1:
        raise error(
            f"--speculative-algorithm {algorithm} needs the checkpoint's MTP (NextN) layer, "
            f"but {model_path}/config.json sets num_nextn_predict_layers = {nextn_layers}; "
            "use a checkpoint that ships its MTP layer, or drop --speculative-algorithm"
        )

#!/usr/bin/env python
"""Build the tiny models: the review LM, its tokenizer and the sentiment reward model
(tests/fixtures/tiny_models.py) into --out, and tiny-tools, a tiny chat model that sometimes calls a
calculator (tests/fixtures/tiny_tools.py, for recipes/tiny_tools.yaml) into --tools-out. The test
suite builds both too, into .cache/ (tests/fixtures/model_cache.py).

Usage: python scripts/make_tiny_models.py [--out models/tiny] [--tools-out models/tiny-tools] [--no-tools]
                                          [--seed 0] [--force]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures import tiny_models, tiny_tools  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--tools-out", type=Path, default=Path("models/tiny-tools"))
    ap.add_argument("--no-tools", action="store_true", help="build the review models only (scripts/demo.sh)")
    args, rest = ap.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        return 0
    done = tiny_models.main(rest)
    if done or args.no_tools:
        return done
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--seed", default="0")
    shared.add_argument("--force", action="store_true")
    known, _ = shared.parse_known_args(rest)
    return tiny_tools.main(["--out", str(args.tools_out), "--seed", known.seed] + (["--force"] if known.force else []))


if __name__ == "__main__":
    sys.exit(main())

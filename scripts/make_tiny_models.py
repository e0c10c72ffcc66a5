#!/usr/bin/env python
"""Build the tiny review LM, its tokenizer and the sentiment reward model (tests/fixtures/tiny_models.py,
where the test suite builds them too).

Usage: python scripts/make_tiny_models.py [--out models/tiny] [--seed 0] [--force]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.tiny_models import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

"""`python tests/run_with_fixtures.py ARGS` = `vitscope ARGS` with the test analyses registered (for torchrun)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import study_fixtures  # noqa: E402

study_fixtures.register()
from vitscope.cli import main  # noqa: E402

sys.exit(main())

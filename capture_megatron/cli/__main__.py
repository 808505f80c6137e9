"""`python -m capture_megatron.cli`: the console script."""

import sys

from capture_megatron.cli import main

sys.exit(main())

"""``python -m cdcd.spark``: see :mod:`cdcd.spark.cli`."""

import sys

from cdcd.spark.cli import main

sys.exit(main())

"""python -m benchmarks.weights: see benchmarks.weights.relay."""

import sys

from benchmarks.weights.relay import main

sys.exit(main())

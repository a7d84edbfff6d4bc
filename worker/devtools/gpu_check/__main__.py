"""``python3 -m worker.devtools.gpu_check``: run the GPU check (see ``check``)."""

import sys

from worker.devtools.gpu_check.check import main

sys.exit(main())

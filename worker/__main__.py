import sys

from mlxq.worker.cli import main

sys.exit(main())

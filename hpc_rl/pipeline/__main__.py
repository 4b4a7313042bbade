import sys

from hpc_rl.pipeline.cli import main

sys.exit(main())

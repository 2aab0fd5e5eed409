import sys

from vitscope.cli import main

sys.exit(main())

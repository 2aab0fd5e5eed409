import sys

from vitscope.cli import main

if __name__ == "__main__":  # a spawned child process (study/helper.py) must not run the CLI again
    sys.exit(main())

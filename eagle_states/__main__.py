import sys

from eagle_states.cli import main

sys.exit(main())

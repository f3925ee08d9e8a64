import sys

from sdpipe.cli import main

sys.exit(main())

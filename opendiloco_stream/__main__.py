import sys

from opendiloco_stream.cli import main

sys.exit(main())

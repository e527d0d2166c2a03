"""`python -m rgpu.remoting.datapath.worker --fd N`: started by the session server."""

import sys

from rgpu.remoting.datapath.worker.session import main

sys.exit(main())

"""``python -m hicached.engine.pd --disaggregation-mode prefill | decode | none``."""

import gc
import sys

from hicached.engine.pd.server import main

code = main()
# the interpreter's last collections would walk every object torch and transformers made, for
# seconds (a PD run stops its processes after every mode): the OS frees them, atexit still runs
gc.freeze()
sys.exit(code)

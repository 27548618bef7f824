"""`python -m caffempi` with the data layers registered even if the layers
package does not import them yet."""
import sys

try:
    import caffempi.layer_types.data  # noqa: F401
except ImportError:
    pass
from caffempi.cli import main

sys.exit(main(sys.argv[1:]))

"""The ``tf-msopt`` command (or ``python -m tf_msopt``).

``tf-msopt compare``: the side-by-side comparison of the optimizers.
``tf-msopt status``: the versions in use and whether the custom ops are loaded.
"""
import argparse
import sys

from tf_msopt import compare


def status(argv=None):
    """Prints the package, TensorFlow and Keras versions, then the custom-op status line."""
    argparse.ArgumentParser(prog="tf-msopt status", description=status.__doc__).parse_args(argv)
    import keras
    import tensorflow as tf

    import tf_msopt as mso

    print(f"tf_msopt {mso.__version__} ({mso.__file__}), TensorFlow {tf.__version__}, "
          f"Keras {keras.__version__}")
    print(mso.ops.custom_ops_status())


COMMANDS = {"compare": compare.main, "status": status}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: tf-msopt {{{','.join(COMMANDS)}}} [options]  (or python -m tf_msopt ...)",
              file=sys.stderr)
        return 2
    COMMANDS[argv[0]](argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``tf-msopt compare`` (or ``python -m tf_msopt compare``): the side-by-side comparison."""
import sys

from tf_msopt import compare

COMMANDS = {"compare": compare.main}


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

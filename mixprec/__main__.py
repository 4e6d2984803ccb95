"""``python -m mixprec`` / the ``mixprec`` console script."""

import sys


def main(argv=None):
    from mixprec.bench.cli import main as _bench_main

    return _bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())

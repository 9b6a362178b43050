"""`python -m kvexport.cli ...`: the same entry point as the `kvexport` script."""

from kvexport.cli import main

if __name__ == "__main__":
    main()

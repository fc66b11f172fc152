"""``python -m pipeexec`` (what torchrun runs: ``torchrun --nproc-per-node N -m pipeexec train ...``)."""
from .cli import main

if __name__ == "__main__":
    main()

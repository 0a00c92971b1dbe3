#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image, with
# the autograder zip unpacked at /autograder/source. The zip is this repository
# with setup.sh, run_autograder and chapter.txt copied to its root (Gradescope
# looks for the first two there); chapters/TEACHING.md says how to build it.
#
# It installs minicb the way `make setup` does everywhere else (.venv in the
# source folder, where run_autograder looks for it), then grades the chapter's
# reference solution once: an autograder that cannot pass the reference fails
# here, at build time, instead of at a student's first submission.
set -euxo pipefail

SOURCE="${AUTOGRADER_SOURCE:-/autograder/source}"
cd "$SOURCE"

# Gradescope's base images are Ubuntu with python3 (3.10 on 22.04; minicb needs 3.10 or newer);
# make and venv may be missing.
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends make python3 python3-venv python3-pip

# The image has no GPU: torch's CPU wheels are a fraction of the default (CUDA) download.
make setup TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"

# The reference solution must pass the grade run_autograder gives (exit 1 or 2 stops the build).
CHAPTER="$(tr -d '[:space:]' < chapter.txt)"
MODULE="$(.venv/bin/python -c 'import sys; from minicb import impl; print(impl.module_for_chapter(int(sys.argv[1])))' "$CHAPTER")"
.venv/bin/python -m minicb check "$CHAPTER" --file "minicb/${MODULE//.//}.py"

# Grading with --full (MINICB_CHECK_ARGS in run_autograder) runs SmolLM2, whose weights are converted
# once into ~/.cache/minicb on first use. Uncomment to do that here, in the image, and not per submission:
# .venv/bin/python -c 'from minicb.weights import load_model; load_model()'

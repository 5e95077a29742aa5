#!/usr/bin/env bash
# Set up the environment and run the default test suite (slow suites run only with ASCENT_RUN_SLOW=1).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
# pytest exit 5 = no tests collected: that is a failure for us, not a silent pass
exit $rc

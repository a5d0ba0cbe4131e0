#!/usr/bin/env bash
# Mutation testing of the modules that carry tddist's guarantees (mutmut 3; configured in
# pyproject.toml, [tool.mutmut]). Not part of CI: a run takes tens of minutes on two cores.
#
#   scripts/mutation.sh [COMMIT]     score COMMIT (default HEAD), as committed
#
# The commit is exported (git archive) into a fresh directory, so the working tree, and
# whatever others are editing in it, is neither read nor disturbed. mutmut copies tddist/
# into mutants/ there, mutates the modules of only_mutate, and runs the fast in-process
# tests of pytest_add_cli_args_test_selection (thread ranks, one process) against each
# mutant. The score per module and every surviving mutant (with its diff) are printed.
#
# Environment: MUTATION_DIR (where to export; default a new temporary directory, kept so
# that `mutmut show NAME` / `mutmut browse` can be run there afterwards), MUTATION_JOBS
# (parallel mutants, default 2).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$repo/.venv/bin"
[ -x "$venv/mutmut" ] || { echo "mutmut is not installed: $venv/pip install 'mutmut>=3.8,<4'" >&2; exit 2; }
commit=$(git -C "$repo" rev-parse --verify "${1:-HEAD}^{commit}")
work=${MUTATION_DIR:-$(mktemp -d -t tddist-mutation.XXXXXX)}
mkdir -p "$work"
git -C "$repo" archive "$commit" | tar -x -C "$work"
echo "scoring commit $commit in $work"
cd "$work"
# pytest's temporary directories stay in the export, apart from other pytest runs on the machine
mkdir -p "$work/tmp"
export TMPDIR="$work/tmp"
start=$(date +%s)
# mutmut exits non-zero when mutants survive; the score below says how many
"$venv/mutmut" run --max-children "${MUTATION_JOBS:-2}" >mutmut-run.log 2>&1 || {
    rc=$?
    grep -q "mutants/" mutmut-run.log 2>/dev/null || { tail -40 mutmut-run.log >&2; exit "$rc"; }
}
echo "mutmut ran for $(( $(date +%s) - start )) s"
"$venv/python" "$repo/scripts/mutation_score.py" --commit "$commit" "$work"

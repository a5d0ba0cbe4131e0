#!/usr/bin/env bash
# Mutation testing of the modules that carry tddist's guarantees (mutmut 3; configured in
# pyproject.toml, [tool.mutmut]). Not part of CI: a run takes tens of minutes on two cores.
#
#   scripts/mutation.sh [COMMIT] [PATTERN...]
#       score COMMIT (default HEAD), as committed; PATTERNs (mutmut's mutant names, with
#       wildcards, e.g. 'tddist.commit.*') check only those mutants
#
# The commit is exported (git archive) into a fresh directory, so the working tree, and
# whatever others are editing in it, is neither read nor disturbed. mutmut copies tddist/
# into mutants/ there, mutates the modules of only_mutate, and runs the fast in-process
# tests of pytest_add_cli_args_test_selection (thread ranks, one process) against each
# mutant. The score per module and every surviving mutant (with its diff) are printed.
#
# Environment: MUTATION_DIR (where to export; default a new temporary directory, kept so
# that `mutmut show NAME` / `mutmut browse` can be run there afterwards), MUTATION_JOBS
# (parallel mutants, default 2), MUTATION_SEED (the directory of an earlier run: its killed
# mutants whose function is unchanged count as killed without running again, since tests are
# only ever added; every other verdict, timeouts included, is checked again).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$repo/.venv/bin"
[ -x "$venv/mutmut" ] || { echo "mutmut is not installed: $venv/pip install 'mutmut>=3.8,<4'" >&2; exit 2; }
commit=$(git -C "$repo" rev-parse --verify "${1:-HEAD}^{commit}")
shift $(( $# > 0 ? 1 : 0 ))
work=${MUTATION_DIR:-$(mktemp -d -t tddist-mutation.XXXXXX)}
mkdir -p "$work"
git -C "$repo" archive "$commit" | tar -x -C "$work"
echo "scoring commit $commit in $work"
cd "$work"
# pytest's temporary directories stay in the export, apart from other pytest runs on the machine
mkdir -p "$work/tmp"
export TMPDIR="$work/tmp"
start=$(date +%s)
# mutmut needs the selected tests green on the unmutated code: a test that fails at this commit
# (work in progress elsewhere) is deselected for the run, and said so, rather than blocking it
"$venv/python" - <<'PY'
import subprocess, sys, tomllib
cfg = tomllib.load(open("pyproject.toml", "rb"))["tool"]["mutmut"]
args = [sys.executable, "-m", "pytest", "-q", "-rf", *cfg["pytest_add_cli_args"], *cfg["pytest_add_cli_args_test_selection"]]
out = subprocess.run(args, capture_output=True, text=True).stdout
failed = sorted({line.split()[1] for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))})
if failed:
    print(f"{len(failed)} selected test(s) fail on the unmutated code of this commit; deselected:")
    print("\n".join(f"  {t}" for t in failed))
    text = open("pyproject.toml").read()
    extra = "".join(f'"--deselect", "{t}", ' for t in failed)
    text = text.replace("pytest_add_cli_args = [", "pytest_add_cli_args = [" + extra, 1)
    open("pyproject.toml", "w").write(text)
PY
if [ -n "${MUTATION_SEED:-}" ]; then
    # mutmut keeps a mutant's verdict while its function's code is unchanged (the hash in the
    # .meta file); the seed's verdicts other than "killed" are cleared so that they run again
    "$venv/python" - "$MUTATION_SEED" <<'PY'
import json, sys
from pathlib import Path
seed, kept = Path(sys.argv[1]) / "mutants", 0
for meta in seed.rglob("*.py.meta"):
    data = json.loads(meta.read_text())
    data["exit_code_by_key"] = {k: (c if c in (1, 3) else None) for k, c in data["exit_code_by_key"].items()}
    kept += sum(c is not None for c in data["exit_code_by_key"].values())
    out = Path("mutants") / meta.relative_to(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data))
print(f"seeded from {seed.parent}: {kept} killed mutant(s) kept where their function is unchanged")
PY
fi
# mutmut exits non-zero when mutants survive; the score below says how many
"$venv/mutmut" run --max-children "${MUTATION_JOBS:-2}" "$@" >mutmut-run.log 2>&1 || true
if grep -q "failed to collect stats" mutmut-run.log || ! ls mutants/tddist/*.meta >/dev/null 2>&1; then
    tr '\r' '\n' <mutmut-run.log | grep -v "Generating mutants\|Running stats" | tail -40 >&2
    echo "mutmut did not run the mutants (see $work/mutmut-run.log)" >&2
    exit 1
fi
echo "mutmut ran for $(( $(date +%s) - start )) s"
"$venv/python" "$repo/scripts/mutation_score.py" --commit "$commit" "$work"

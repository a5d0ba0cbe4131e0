#!/usr/bin/env bash
# Mutation testing of the modules that carry tddist's guarantees (mutmut 3; configured in
# pyproject.toml, [tool.mutmut]). Not part of CI: a run takes tens of minutes on two cores.
#
#   scripts/mutation.sh [COMMIT] [PATTERN...]
#       score COMMIT (default HEAD), as committed; PATTERNs (mutmut's mutant names, with
#       wildcards, e.g. 'tddist.saving.commit.*') check only those mutants
#
# The commit is exported (git archive) into a fresh directory, so the working tree, and
# whatever others are editing in it, is neither read nor disturbed. mutmut copies tddist/
# into mutants/ there, mutates the modules of only_mutate, and runs the fast in-process
# tests of pytest_add_cli_args_test_selection (thread ranks, one process) against each
# mutant. The score per module and every surviving mutant (with its diff) are printed.
#
# Environment: MUTATION_DIR (where to export; default a new temporary directory, kept so
# that `mutmut show NAME` / `mutmut browse` can be run there afterwards), MUTATION_JOBS
# (parallel mutants, default 2), MUTATION_SEED (directories of earlier runs, joined by ':': their killed
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
    # .meta file); only "killed" verdicts are taken from the seeds (the union over them), the
    # others are cleared so that they run again. Seeds must be runs of the same functions' code:
    # a function whose hash differs between seeds is run again.
    "$venv/python" - "$MUTATION_SEED" <<'PY'
import json, sys
from pathlib import Path
seeds = [Path(d) / "mutants" for d in sys.argv[1].split(":") if d]
merged: dict[Path, dict] = {}
for seed in seeds:
    for meta in seed.rglob("*.py.meta"):
        rel, data = meta.relative_to(seed), json.loads(meta.read_text())
        killed = {k for k, c in data["exit_code_by_key"].items() if c in (1, 3)}
        if rel not in merged:
            merged[rel] = {**data, "exit_code_by_key": {k: (1 if k in killed else None) for k in data["exit_code_by_key"]}}
            continue
        into = merged[rel]
        same = {f for f, h in data["hash_by_function_name"].items() if into["hash_by_function_name"].get(f) == h}
        for k in killed:
            if k in into["exit_code_by_key"] and k.rsplit("__mutmut_", 1)[0].rsplit(".", 1)[-1] in same:
                into["exit_code_by_key"][k] = 1
        for f in set(into["hash_by_function_name"]) - same:  # code differs between seeds: run it again
            for k in into["exit_code_by_key"]:
                if k.rsplit("__mutmut_", 1)[0].rsplit(".", 1)[-1] == f:
                    into["exit_code_by_key"][k] = None
kept = 0
for rel, data in merged.items():
    kept += sum(c is not None for c in data["exit_code_by_key"].values())
    out = Path("mutants") / rel
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data))
print(f"seeded from {', '.join(str(s.parent) for s in seeds)}: {kept} killed mutant(s), kept where their function is unchanged")
PY
fi
# mutmut exits non-zero when mutants survive; the score below says how many
"$venv/mutmut" run --max-children "${MUTATION_JOBS:-2}" "$@" >mutmut-run.log 2>&1 || true
if grep -q "failed to collect stats" mutmut-run.log || [ -z "$(find mutants/tddist -name "*.meta" -print -quit 2>/dev/null)" ]; then
    tr '\r' '\n' <mutmut-run.log | grep -v "Generating mutants\|Running stats" | tail -40 >&2
    echo "mutmut did not run the mutants (see $work/mutmut-run.log)" >&2
    exit 1
fi
echo "mutmut ran for $(( $(date +%s) - start )) s"
"$venv/python" "$repo/scripts/mutation_score.py" --commit "$commit" "$work"

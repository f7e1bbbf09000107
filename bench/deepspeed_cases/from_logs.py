"""Rebuild result entries from run.py's console lines (used once, when an early --resume bug dropped entries).

    python bench/deepspeed_cases/from_logs.py IMPL LOG [LOG...]   -> merges into bench/results/deepspeed_cases_IMPL.json
Entries already in the JSON win; rebuilt ones carry "from_log": true (no traceback kept).
"""
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LINE = re.compile(r"^\[\d+/\d+\] (.+) \((\d)\): (pass|fail|error)(?:  (.*?) @ (.*))?$")


def main():
    impl, logs = sys.argv[1], sys.argv[2:]
    out = os.path.join(HERE, "..", "results", f"deepspeed_cases_{impl}.json")
    data = json.load(open(out)) if os.path.exists(out) else {"impl": impl, "cases": {}}
    for log in logs:
        for ln in open(log):
            m = LINE.match(ln.rstrip("\n"))
            if m and m.group(1) not in data["cases"]:
                name, w, st, exc, where = m.groups()
                r = {"status": st, "world_size": int(w), "from_log": True}
                if st != "pass":
                    r.update(exception=exc, line=where)
                data["cases"][name] = r
    sys.path.insert(0, HERE)
    import run
    defined = [c[1] for c in run.all_cases()]
    data["cases"] = {n: data["cases"][n] for n in defined if n in data["cases"]}
    data["totals"] = {s: sum(1 for x in data["cases"].values() if x["status"] == s) for s in ("pass", "fail", "error")}
    data["n"], data["n_defined"] = len(data["cases"]), len(defined)
    data["complete"] = data["n"] == len(defined)
    json.dump(data, open(out, "w"), indent=1)
    print(impl, data["totals"], data["n"], "of", len(defined))


if __name__ == "__main__":
    main()

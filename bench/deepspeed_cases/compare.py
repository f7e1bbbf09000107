"""Compare bench/results/deepspeed_cases_{deepspeed,zeropp}.json: cases DeepSpeed passes and zeropp does not."""
import json
import os
import sys

R = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results")


def load(impl):
    p = os.path.join(R, f"deepspeed_cases_{impl}.json")
    return json.load(open(p)) if os.path.exists(p) else {"cases": {}}


def main():
    d, z = load("deepspeed"), load("zeropp")
    for name, r in (("deepspeed", d), ("zeropp", z)):
        print(name, r.get("totals"), "of", r.get("n"), "run;", r.get("n_defined"), "defined; complete:", r.get("complete"))
    both = [n for n in d["cases"] if n in z["cases"]]
    dpass = [n for n in both if d["cases"][n]["status"] == "pass"]
    print(f"run on both: {len(both)}; DeepSpeed passes {len(dpass)}; zeropp passes "
          f"{sum(z['cases'][n]['status'] == 'pass' for n in dpass)} of those")
    print("zeropp passes, DeepSpeed does not:",
          [n for n in both if z["cases"][n]["status"] == "pass" and d["cases"][n]["status"] != "pass"])
    for n in both:
        if d["cases"][n]["status"] != "pass":
            print("  DS not pass:", n, d["cases"][n].get("exception"), "@", d["cases"][n].get("line"))
    print("\nDeepSpeed passes, zeropp does not:")
    for n in dpass:
        r = z["cases"][n]
        if r["status"] != "pass":
            print(f"- {n}: {r['status']}: {r.get('exception')}\n    at {r.get('line')}\n    deepest {r.get('deepest', '')}")


if __name__ == "__main__":
    main()

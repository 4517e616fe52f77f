#!/usr/bin/env python3
"""Port of upstream's test normalisation (pkg/proxy/iptables/proxier_test.go
sortIPTablesRules + pkg/util/iptables/testing/parse.go IPTablesDump.String()).

Reads hand-written restore input (one or more syncs, each introduced by a
"# sync N: full|partial" header line) and prints each sync in canonical form,
keeping the header lines.  Only ordering is changed; rule text is untouched.
"""
import functools
import re
import sys

WORD = re.compile(r'(?:^|\s)("[^"]*"|[^"]\S*)')


def comment_of(raw):
    words = [m.strip('"') for m in WORD.findall(raw)]
    for i, w in enumerate(words):
        if w == "--comment" and i + 1 < len(words):
            return words[i + 1]
    return None


def svc_name(c):
    for i, ch in enumerate(c):
        if ch in " :":
            return c[:i]
    return c


def order_by_comment(r1, r2):
    c1, c2 = comment_of(r1), comment_of(r2)
    if c1 is None or c2 is None:
        return False
    return svc_name(c1) < svc_name(c2)


def stable_sort(rules, less):
    # Go's sort.SliceStable with a "less" function == insertion-stable sort.
    def cmp(a, b):
        if less(a, b):
            return -1
        if less(b, a):
            return 1
        return 0
    return sorted(rules, key=functools.cmp_to_key(cmp))


def chain_key(name):
    if name == "KUBE-NODEPORTS":
        return (0, "")
    if name == "KUBE-SERVICES":
        return (1, "")
    if name.startswith("KUBE-"):
        return (2, name)
    return (3, name)


def canon(text):
    tables = []  # list of [name, chains(list of names), rules(dict name->list), deleted(set)]
    state = "table"
    t = None
    for line in text.strip("\n").split("\n"):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        while True:
            if state == "table":
                m = re.match(r"^\*(.*)$", line)
                assert m, line
                t = {"name": m.group(1), "chains": [], "rules": {}, "deleted": set()}
                tables.append(t)
                state = "decl"
                break
            if state == "decl":
                m = re.match(r"^:(\S+)\s+\S+\s+\[(\d+):(\d+)\]$", line)
                if not m:
                    state = "rules"
                    continue
                assert m.group(1) not in t["rules"], "duplicate chain " + m.group(1)
                t["chains"].append(m.group(1))
                t["rules"][m.group(1)] = []
                break
            if state == "rules":
                m = re.match(r"^:(\S+)\s+\S+\s+\[(\d+):(\d+)\]$", line)
                if m:
                    # Hand-written derivations may declare a chain next to its rules
                    # (upstream writes chain lines to a separate buffer that precedes
                    # all rules, so this is equivalent).
                    state = "decl"
                    continue
                if line == "COMMIT":
                    state = "table"
                    break
                m = re.match(r"^-A (\S+)", line)
                if m:
                    assert m.group(1) in t["rules"], "undeclared chain in " + line
                    t["rules"][m.group(1)].append(line)
                    break
                m = re.match(r"^-X (\S+)$", line)
                assert m, "bad line " + line
                assert m.group(1) in t["rules"] and not t["rules"][m.group(1)], line
                t["deleted"].add(m.group(1))
                break
    tables.sort(key=lambda t: t["name"])
    out = []
    for t in tables:
        t["chains"].sort(key=chain_key)
        r = t["rules"]
        if t["name"] == "filter":
            for c in ("KUBE-NODEPORTS", "KUBE-SERVICES"):
                if c in r:
                    r[c] = stable_sort(r[c], order_by_comment)
        if t["name"] == "nat":
            if "KUBE-NODEPORTS" in r:
                r["KUBE-NODEPORTS"] = stable_sort(r["KUBE-NODEPORTS"], order_by_comment)
            if "KUBE-SERVICES" in r:
                def less(a, b):
                    ca, cb = comment_of(a), comment_of(b)
                    if ca is not None and "must be the last rule" in ca:
                        return False
                    if cb is not None and "must be the last rule" in cb:
                        return True
                    return order_by_comment(a, b)
                r["KUBE-SERVICES"] = stable_sort(r["KUBE-SERVICES"], less)
        out.append("*" + t["name"])
        out += [":%s - [0:0]" % c for c in t["chains"]]
        for c in t["chains"]:
            out += r[c]
        out += ["-X " + c for c in t["chains"] if c in t["deleted"]]
        out.append("COMMIT")
    return "\n".join(out) + "\n"


def main():
    data = open(sys.argv[1]).read() if len(sys.argv) > 1 else sys.stdin.read()
    parts = re.split(r"^(# sync \d+: (?:full|partial))\s*$", data, flags=re.M)
    assert parts[0].strip() == "", "input must start with a '# sync N: ...' header"
    res = []
    for i in range(1, len(parts), 2):
        res.append(parts[i] + "\n" + canon(parts[i + 1]))
    sys.stdout.write("".join(res))


if __name__ == "__main__":
    main()

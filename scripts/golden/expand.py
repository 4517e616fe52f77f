#!/usr/bin/env python3
"""Turn a hand-written rule derivation into expected.rules.

The derivation (*.raw) is plain iptables-restore text, written by hand from the
upstream Go source, with two conveniences:
  * chain names as placeholders, computed with chainhash.py:
      {SVC spn proto} {SVL spn proto} {EXT spn proto} {FW spn proto} {SEP spn proto ip:port}
  * lines starting with ";;" are notes and dropped.
The result is then put into upstream's canonical test order by canon.py.
"""
import re
import sys

sys.path.insert(0, __import__("os").path.dirname(__file__))
import chainhash  # noqa: E402
import canon  # noqa: E402

PH = re.compile(r"\{(SVC|SVL|EXT|FW|SEP) ([^ }]+) ([a-z]+)(?: ([^ }]+))?\}")


def sub(m):
    kind, spn, proto, ep = m.groups()
    spn = "" if spn == "-" else spn
    if kind == "SEP":
        return chainhash.sep(spn, proto, ep)
    return getattr(chainhash, kind.lower())(spn, proto)


def main():
    text = open(sys.argv[1]).read()
    lines = [l for l in text.split("\n") if not l.startswith(";;")]
    text = PH.sub(sub, "\n".join(lines))
    parts = re.split(r"^(# sync \d+: (?:full|partial))\s*$", text, flags=re.M)
    assert parts[0].strip() == "", "must start with '# sync N: ...'"
    out = []
    for i in range(1, len(parts), 2):
        out.append(parts[i] + "\n" + canon.canon(parts[i + 1]))
    sys.stdout.write("".join(out))


if __name__ == "__main__":
    main()

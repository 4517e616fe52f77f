#!/usr/bin/env python3
"""Generates tests/golden/large-cluster{,-threshold}/{cluster.yaml,derivation.raw}.

The derivation encodes, by hand, what upstream syncProxyRules writes (see the ";;" notes);
expand.py then turns derivation.raw into expected.rules.

large-cluster:           big/backend:http has 999 ready + 1 not-ready endpoint (1000 in the
                         endpoints map), big/frontend:http (NodePort, ClientIP affinity) has 1:
                         totalEndpoints = 1001 > 1000 => largeClusterMode.
large-cluster-threshold: same backend (1000), frontend has no endpoints; an orphan slice (no
                         Service) and a slice port the Service does not have add endpoints that
                         are NOT counted (the count runs over svcPortMap) => 1000, not large.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "..", "tests", "golden")

NODE = open(os.path.join(HERE, "node.yaml")).read()

HEAD = """*filter
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-FIREWALL - [0:0]
-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x00004000/0x00004000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
"""
HEAD_NAT = """COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
-A KUBE-POSTROUTING -m mark ! --mark 0x00004000/0x00004000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x00004000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x00004000
"""
TAIL = """-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
COMMIT
"""

BACKEND_SVC = """---
apiVersion: v1
kind: Service
metadata: {namespace: big, name: backend}
spec:
  type: ClusterIP
  clusterIP: 172.30.10.10
  clusterIPs: [172.30.10.10]
  ipFamilies: [IPv4]
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: 8080}
"""
FRONTEND_SVC = """---
apiVersion: v1
kind: Service
metadata: {namespace: big, name: frontend}
spec:
  type: NodePort
  clusterIP: 172.30.10.11
  clusterIPs: [172.30.10.11]
  ipFamilies: [IPv4]
  externalTrafficPolicy: Cluster
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 300}}
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 31150}
"""

NOT_READY = 500  # index of the not-ready backend endpoint


def backend_ips():
    return ["10.65.%d.%d" % (i // 250, i % 250 + 1) for i in range(1000)]


def slice_yaml(ns, name, svc, port_name, port, eps):
    out = ["---", "apiVersion: discovery.k8s.io/v1", "kind: EndpointSlice", "metadata:",
           "  namespace: %s" % ns, "  name: %s" % name, "  labels: {kubernetes.io/service-name: %s}" % svc,
           "addressType: IPv4", "ports:", "- {name: %s, port: %d, protocol: TCP}" % (port_name, port), "endpoints:"]
    for ip, ready, node in eps:
        out.append("- addresses: [%s]" % ip)
        out.append("  conditions: {ready: %s}" % ("true" if ready else "false"))
        out.append("  nodeName: %s" % node)
    return "\n".join(out) + "\n"


def backend_slices():
    ips = backend_ips()
    res = ""
    # four slices of 250, as the EndpointSlice controller would cut them (max 100 by default,
    # but any split is equivalent)
    for s in range(4):
        eps = [(ips[i], i != NOT_READY, "node-b") for i in range(s * 250, (s + 1) * 250)]
        res += slice_yaml("big", "backend-%d" % s, "backend", "http", 8080, eps)
    return res


def prob(n):
    return "%0.10f" % (1.0 / n)


def backend_rules(large):
    spn = "big/backend:http"
    ready = sorted("%s:8080" % ip for i, ip in enumerate(backend_ips()) if i != NOT_READY)
    assert len(ready) == 999
    lines = [";; --- %s: %d ready endpoints, sorted as strings" % (spn, len(ready)),
             '-A KUBE-SERVICES -m comment --comment "%s cluster IP" -m tcp -p tcp -d 172.30.10.10 --dport 80 -j {SVC %s tcp}' % (spn, spn),
             ":{SVC %s tcp} - [0:0]" % spn]
    n = len(ready)
    for i, ep in enumerate(ready):
        c = "" if large else ' -m comment --comment "%s -> %s"' % (spn, ep)
        st = " -m statistic --mode random --probability %s" % prob(n - i) if i < n - 1 else ""
        lines.append("-A {SVC %s tcp}%s%s -j {SEP %s tcp %s}" % (spn, c, st, spn, ep))
    for ep in ready:
        ip = ep.split(":")[0]
        c = "" if large else " -m comment --comment %s" % spn
        sep = "{SEP %s tcp %s}" % (spn, ep)
        lines.append(":%s - [0:0]" % sep)
        lines.append("-A %s%s -s %s -j KUBE-MARK-MASQ" % (sep, c, ip))
        lines.append("-A %s%s -m tcp -p tcp -j DNAT --to-destination %s" % (sep, c, ep))
    return "\n".join(lines) + "\n"


def write(name, cluster, raw):
    d = os.path.join(GOLDEN, name)
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, "cluster.yaml"), "w").write(cluster)
    open(os.path.join(d, "derivation.raw"), "w").write(raw)
    open(os.path.join(d, "args"), "w").write("--hostname-override\nnode-a\n")


def large_cluster():
    cluster = NODE + BACKEND_SVC + backend_slices() + FRONTEND_SVC + slice_yaml(
        "big", "frontend-1", "frontend", "http", 8080, [("10.64.1.150", True, "node-a")])
    spn = "big/frontend:http"
    ep = "10.64.1.150:8080"
    sep = "{SEP %s tcp %s}" % (spn, ep)
    front = "\n".join([
        ";; --- big/frontend:http : NodePort + ClientIP affinity; large mode drops the comments",
        ";; of the SVC->SEP rules (affinity + probability) and of both SEP rules only",
        '-A KUBE-SERVICES -m comment --comment "%s cluster IP" -m tcp -p tcp -d 172.30.10.11 --dport 80 -j {SVC %s tcp}' % (spn, spn),
        "-A KUBE-NODEPORTS -m comment --comment %s -m tcp -p tcp --dport 31150 -j {EXT %s tcp}" % (spn, spn),
        ":{EXT %s tcp} - [0:0]" % spn,
        '-A {EXT %s tcp} -m comment --comment "masquerade traffic for %s external destinations" -j KUBE-MARK-MASQ' % (spn, spn),
        "-A {EXT %s tcp} -j {SVC %s tcp}" % (spn, spn),
        ":{SVC %s tcp} - [0:0]" % spn,
        "-A {SVC %s tcp} -m recent --name %s --rcheck --seconds 300 --reap -j %s" % (spn, sep, sep),
        "-A {SVC %s tcp} -j %s" % (spn, sep),
        ":%s - [0:0]" % sep,
        "-A %s -s 10.64.1.150 -j KUBE-MARK-MASQ" % sep,
        "-A %s -m recent --name %s --set -m tcp -p tcp -j DNAT --to-destination %s" % (sep, sep, ep),
    ]) + "\n"
    raw = "# sync 1: full\n;; totalEndpoints = 1000 (backend, incl. 1 not ready) + 1 (frontend) = 1001 > 1000\n" \
        + HEAD + HEAD_NAT + backend_rules(True) + front + TAIL
    write("large-cluster", cluster, raw)


def threshold():
    ghost = slice_yaml("big", "ghost-1", "ghost", "http", 8080,
                       [("10.66.0.%d" % i, True, "node-b") for i in range(1, 6)])
    other_port = slice_yaml("big", "backend-metrics", "backend", "metrics", 9090,
                            [("10.66.1.%d" % i, True, "node-b") for i in range(1, 4)])
    cluster = NODE + BACKEND_SVC + backend_slices() + other_port + FRONTEND_SVC + ghost
    spn = "big/frontend:http"
    front = "\n".join([
        ";; --- big/frontend:http : no endpoints => REJECT in filter (cluster IP and node port)",
    ]) + "\n"
    filt = "\n".join([
        '-A KUBE-SERVICES -m comment --comment "%s has no endpoints" -m tcp -p tcp -d 172.30.10.11 --dport 80 -j REJECT' % spn,
        '-A KUBE-EXTERNAL-SERVICES -m comment --comment "%s has no endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 31150 -j REJECT' % spn,
    ]) + "\n"
    raw = ("# sync 1: full\n;; totalEndpoints = 1000 (backend:http incl. 1 not ready); big/backend:metrics and\n"
           ";; big/ghost have no Service port => not counted => not large-cluster mode\n"
           + HEAD + filt + HEAD_NAT + backend_rules(False) + front + TAIL)
    write("large-cluster-threshold", cluster, raw)


if __name__ == "__main__":
    large_cluster()
    threshold()

#!/usr/bin/env python3
"""Chain-name hashes exactly as upstream kube-proxy (iptables) computes them.

portProtoHash(servicePortName, protocol) = base32(sha256(servicePortName + protocol))[:16]
servicePortEndpointChainName(spn, proto, ep) = "KUBE-SEP-" + base32(sha256(spn + proto + ep))[:16]

Usage:
  chainhash.py svc  'ns/name:port' tcp            -> SVC/SVL/EXT/FW names
  chainhash.py sep  'ns/name:port' tcp 10.0.0.1:80 -> KUBE-SEP-... name
"""
import base64
import hashlib
import sys


def port_proto_hash(spn: str, proto: str) -> str:
    return base64.b32encode(hashlib.sha256((spn + proto).encode()).digest()).decode()[:16]


def svc(spn, proto):
    return "KUBE-SVC-" + port_proto_hash(spn, proto)


def svl(spn, proto):
    return "KUBE-SVL-" + port_proto_hash(spn, proto)


def ext(spn, proto):
    return "KUBE-EXT-" + port_proto_hash(spn, proto)


def fw(spn, proto):
    return "KUBE-FW-" + port_proto_hash(spn, proto)


def sep(spn: str, proto: str, ep: str) -> str:
    return "KUBE-SEP-" + base64.b32encode(hashlib.sha256((spn + proto + ep).encode()).digest()).decode()[:16]


if __name__ == "__main__":
    if sys.argv[1] == "svc":
        h = port_proto_hash(sys.argv[2], sys.argv[3])
        print(h)
    else:
        print(sep(sys.argv[2], sys.argv[3], sys.argv[4]))

#!/usr/bin/env bash
# Makes a throw-away PKI for the TLS tests with the openssl CLI (P-256 keys,
# valid for 2 days) in the directory given as $1:
#   ca.pem ca.key              the CA every service and client trusts
#   server.pem server.key      signed by ca; SANs localhost, 127.0.0.1 and
#                              specserve-internal (for --*server_name tests)
#   client.pem client.key      signed by ca; clientAuth (mutual TLS)
#   other_ca.pem other_ca.key  an unrelated CA
#   other_client.pem/.key      signed by other_ca (a client mTLS must refuse)
set -euo pipefail
out=${1:?usage: make_test_certs.sh OUTDIR}
mkdir -p "$out"
cd "$out"

ca() {  # name CN
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$1.key" -out "$1.pem" -days 2 -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

leaf() {  # name CA CN extensions
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$1.key" -out "$1.csr" -subj "/CN=$3" 2>/dev/null
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" \
    -set_serial "0x$(openssl rand -hex 8)" -days 2 -out "$1.pem" \
    -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

ca ca "specserve test CA"
ca other_ca "unrelated test CA"
leaf server ca localhost "subjectAltName=DNS:localhost,DNS:specserve-internal,IP:127.0.0.1
extendedKeyUsage=serverAuth,clientAuth
basicConstraints=CA:FALSE"
leaf client ca specserve-client "extendedKeyUsage=clientAuth
basicConstraints=CA:FALSE"
leaf other_client other_ca intruder "extendedKeyUsage=clientAuth
basicConstraints=CA:FALSE"

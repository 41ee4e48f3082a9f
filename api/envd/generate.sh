#!/usr/bin/env sh
# Regenerates the Go code for the envd-compatible wire contracts
# (api/envd/process, api/envd/filesystem). The generated code is committed:
# builds never need protoc. Requires protoc (apt-get install protobuf-compiler);
# the Go plugins are installed at the versions pinned in go.mod.
set -eu
cd "$(dirname "$0")"
ROOT=$(cd ../.. && pwd)
BIN="${GOBIN:-$(go env GOPATH)/bin}"
PBVER=$(cd "$ROOT" && go list -m -f '{{.Version}}' google.golang.org/protobuf)
CNVER=$(cd "$ROOT" && go list -m -f '{{.Version}}' connectrpc.com/connect)
if ! command -v protoc >/dev/null 2>&1; then
	echo "protoc not found: apt-get install -y protobuf-compiler" >&2
	exit 1
fi
GOBIN="$BIN" go install "google.golang.org/protobuf/cmd/protoc-gen-go@$PBVER"
GOBIN="$BIN" go install "connectrpc.com/connect/cmd/protoc-gen-connect-go@$CNVER"
PATH="$BIN:$PATH"
for p in process/process.proto filesystem/filesystem.proto; do
	protoc -I . \
		--go_out=. --go_opt=paths=source_relative \
		--connect-go_out=. --connect-go_opt=paths=source_relative \
		"$p"
done

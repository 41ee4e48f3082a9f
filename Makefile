# SPACE build, run and test entry points. Everything a target needs (Go
# modules, npm packages for the SDK tests, Debian packages) is installed by
# the target itself.
SHELL      := /bin/bash
GO         ?= go
BIN        := $(CURDIR)/bin
export GOFLAGS := -buildvcs=false
GOTESTFLAGS ?= -race -count=1 -timeout 25m
GOTESTUNITFLAGS ?= -count=1 -timeout 10m
# PKGS narrows make test / make test-unit, e.g. PKGS=./internal/edge/...
PKGS ?= ./...
# Every go test run is read through the reporter: it prints what plain go
# test prints, then the list of tests and packages that did not run (see
# docs/TESTING.md), and keeps go test's verdict.
NOTRUN := $(GO) run ./internal/testenv/notrun
STATICCHECK_VERSION ?= v0.8.2

CMDS := space space-api space-edge space-node spaced-host netgtw space-nsinit

# space --version (GOFLAGS has -buildvcs=false, so the build records no
# revision by itself): the commit, stamped into internal/cli.Version.
SPACE_VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo devel)
SPACE_LDFLAGS := -X github.com/spacesbx/space/internal/cli.Version=$(SPACE_VERSION)

.PHONY: all build run test test-unit bench density check fuzz e2e-deps deps vm-deps sandbox-deps base-image clean churn crash cluster-test

all: build

## build: all binaries into ./bin (spaced-guest is static: it runs inside sandboxes)
build: vm-deps sandbox-deps base-image code-interpreter-image
	@mkdir -p $(BIN)
	$(GO) build -ldflags '$(SPACE_LDFLAGS)' -o $(BIN)/ $(addprefix ./cmd/,$(CMDS))
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='-s -w' -o $(BIN)/spaced-guest ./cmd/spaced-guest

## run: build and start a single-machine SPACE (etcd, control plane, workers, edge)
run: build localhost-names
	$(BIN)/space up $(ARGS)

## sandbox-deps: what ns sandboxes use from the host's /usr (bind-mounted
## read-only into each): sudo (E2B users run `sudo` as `user`; it makes a
## process root only in the sandbox's user namespace) and python3; and
## e2fsprogs, whose mkfs.ext4 formats the layer disks (the disk quota)
sandbox-deps:
	@dpkg -s sudo python3 e2fsprogs curl ca-certificates >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends sudo python3 e2fsprogs curl ca-certificates; }

## base-image: the Debian root file system of the `base` template (E2B's
## base set: python3, nodejs, git, build tools, sudo, user 1000), built by
## mmdebstrap from deb.debian.org once per content ID into
## /var/cache/space/images (minutes the first time, instant after). If it
## cannot be built, `base` sandboxes run on the host's /usr (base-host).
base-image:
	@command -v mmdebstrap >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap; } || true
	@$(GO) run ./cmd/space-baseimage || echo 'base-image: not built (see above): base sandboxes will run on the host /usr (template base-host)'

## code-interpreter-image: the code-interpreter-v1 template's image, one
## layer over the base image (Python's data stack from Debian, Deno from
## npm with its Jupyter kernel, the code interpreter server), built once per
## content ID into the same cache. Without it code-interpreter-v1 creates
## fail with "template ... is not available on this worker".
.PHONY: code-interpreter-image
code-interpreter-image: base-image
	@$(GO) run ./cmd/space-baseimage -code-interpreter || echo 'code-interpreter-image: not built (see above): code-interpreter-v1 sandboxes are unavailable'

## deps: system packages the tests use
deps:
	@command -v node >/dev/null || { apt-get update -qq && apt-get install -y -qq nodejs npm; }

## deploy-deps: Debian's systemd, whose systemd-analyze verify reads the
## units of deploy/systemd in internal/deploycheck's tests (only the tool
## is used; nothing is started)
.PHONY: deploy-deps
deploy-deps:
	@command -v systemd-analyze >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd; }

## registry-deps: Debian's docker-registry (the CNCF distribution registry),
## which internal/oci's tests start on 127.0.0.1 with a temp storage dir.
## Only the binary is used: the package's own service (port 5000) is
## disabled and stopped where systemd runs.
.PHONY: registry-deps
registry-deps:
	@dpkg -s docker-registry >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-registry && \
	  { ! command -v systemctl >/dev/null || systemctl disable --now docker-registry.service >/dev/null 2>&1 || true; }; }

## etcd-deps: Debian's etcd (etcd-server, etcd-client: /usr/bin/etcd and
## etcdctl; etcdutl only from 3.5, else `etcdctl snapshot restore`), which
## test/cluster runs as a three-member cluster on network-namespace hosts.
## Only the binaries are used: the package's own service (port 2379 on the
## loopback) is disabled and stopped where systemd runs.
.PHONY: etcd-deps
etcd-deps:
	@dpkg -s etcd-server etcd-client >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server etcd-client && \
	  { ! command -v systemctl >/dev/null || systemctl disable --now etcd.service >/dev/null 2>&1 || true; }; }

## codeinterp-deps: what internal/codeinterp's tests run the code
## interpreter server on (what its image holds): Debian's Jupyter client,
## IPython kernel, matplotlib, pandas and numpy for /usr/bin/python3, and
## Deno (npm, version and integrity in the lock file) for its JS/TS kernel.
CODEINTERP_PKGS := python3-ipykernel python3-jupyter-client python3-matplotlib python3-pandas python3-numpy
CODEINTERP_DENO := $(CURDIR)/.cache/codeinterp-deno
.PHONY: codeinterp-deps
codeinterp-deps: deps $(CODEINTERP_DENO)/node_modules/.package-lock.json
	@dpkg -s $(CODEINTERP_PKGS) >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(CODEINTERP_PKGS); }
$(CODEINTERP_DENO)/node_modules/.package-lock.json: internal/codeinterp/testdata/deno/package.json internal/codeinterp/testdata/deno/package-lock.json
	@mkdir -p $(CODEINTERP_DENO) && cp internal/codeinterp/testdata/deno/package*.json $(CODEINTERP_DENO)/
	npm ci --prefix $(CODEINTERP_DENO) --no-audit --no-fund --loglevel=error
	chmod 0755 $(CODEINTERP_DENO)/node_modules/@deno/linux-x64-glibc/deno

## e2e-deps: the unmodified e2b npm SDK for the end-to-end tests (and the
## *.localhost names direct-urls.test.mjs fetches)
e2e-deps: deps localhost-names test/e2e/node_modules/.package-lock.json
test/e2e/node_modules/.package-lock.json: test/e2e/package.json test/e2e/package-lock.json
	npm ci --prefix test/e2e --no-audit --no-fund --loglevel=error

## localhost-names: the direct sandbox URLs https://<port>-<id>.localhost:3443
## resolve to the loopback for every program on this machine (Node's fetch,
## curl, browsers): glibc's myhostname NSS module (Debian's
## libnss-myhostname) answers *.localhost. Installs it and puts `myhostname`
## after `files` on the hosts line of /etc/nsswitch.conf, once (idempotent;
## this is the only system file it edits). Undo: remove the word there.
.PHONY: localhost-names
localhost-names:
	@dpkg -s libnss-myhostname >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libnss-myhostname; }
	@grep -Eq '^hosts:.*[[:space:]]myhostname([[:space:]]|$$)' /etc/nsswitch.conf || { \
	  if grep -Eq '^hosts:.*[[:space:]]files([[:space:]]|$$)' /etc/nsswitch.conf; then \
	    sed -i -E 's/^(hosts:.*[[:space:]]files)([[:space:]]|$$)/\1 myhostname\2/' /etc/nsswitch.conf; \
	  else sed -i -E 's/^(hosts:.*)$$/\1 myhostname/' /etc/nsswitch.conf; fi; \
	  echo 'localhost-names: added myhostname to the hosts line of /etc/nsswitch.conf'; }
	@getent hosts space-probe.localhost >/dev/null && echo 'localhost-names: *.localhost resolves to the loopback' || \
	  echo 'localhost-names: *.localhost does not resolve: check the hosts line of /etc/nsswitch.conf'

## vm-deps: what the microvm substrate runs on: QEMU, a static busybox (the
## guest's userland) and the cloud kernel (vmlinuz + modules) Debian serves
## today, extracted once per version into /var/cache/space/vm-kernel and
## linked at $(VM_KERNEL_DIR); never installed into /boot. Fast when done.
VM_KERNEL_DIR := $(CURDIR)/.cache/vm/kernel
VM_KERNEL_META ?= linux-image-cloud-amd64
vm-deps: $(VM_KERNEL_DIR)/.done
	@dpkg -s qemu-system-x86 busybox-static >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86 busybox-static; }
$(VM_KERNEL_DIR)/.done:
	@scripts/vm-kernel.sh "$(VM_KERNEL_DIR)" "$(VM_KERNEL_META)"

## test: the whole suite, every tier: unit, root, platform (space up, the
## hostile suite, end to end with the e2b SDK) and kvm; run it as root.
## Ends with the list of what did not run (docs/TESTING.md).
## It includes test/cluster (about 3 minutes; make cluster-test runs it
## alone and prints its report).
test: build e2e-deps registry-deps codeinterp-deps deploy-deps etcd-deps
	@[ "$$(id -u)" = 0 ] || echo 'make test: not root: the root and platform tiers will not run (see the NOT RUN list at the end)'
	set -o pipefail; SPACE_BIN_DIR=$(BIN) $(GO) test $(GOTESTFLAGS) -json $(PKGS) | $(NOTRUN)

## cluster-test: test/cluster, SPACE as a cluster of network-namespace
## hosts on one machine (internal/hostsim): 3 etcd members (Debian's etcd),
## 2 control planes, 2 edges and 3 workers, each on its own host, under
## client load; one etcd member, one control plane, one edge and one worker
## host killed and restarted in turn, a worker partitioned for 30 s; then
## an etcd backup restored into a fresh cluster. About 3 minutes, as root;
## make test runs it too.
## Prints the report table (also in $(CLUSTER_OUT)/.../cluster-report.txt).
CLUSTER_OUT := $(CURDIR)/.cache/cluster-test
cluster-test: build etcd-deps
	@rm -rf $(CLUSTER_OUT) && mkdir -p $(CLUSTER_OUT)
	set -o pipefail; SPACE_BIN_DIR=$(BIN) $(GO) test -race -count=1 -timeout 30m -json -artifacts -outputdir $(CLUSTER_OUT) ./test/cluster/ | $(NOTRUN); \
	  rc=$$?; find $(CLUSTER_OUT) -name cluster-report.txt -exec cat {} \; ; exit $$rc

## test-unit: the inner loop: the unit tier only (go test -short; no root,
## no built binaries, no platform), as any user. Ends
## with the list of what did not run.
test-unit:
	set -o pipefail; $(GO) test -short $(GOTESTUNITFLAGS) -json $(PKGS) | $(NOTRUN)

## bench: benchmarks, each figure beside its baseline from the same run
bench: build
	SPACE_BIN_DIR=$(BIN) $(GO) run ./cmd/space-bench

## density: how many idle ns sandboxes one host holds (DENSITY, default 2500;
## takes minutes): tasks, processes and PSS per sandbox, exec p50 at that
## density beside low density; stops early, saying why, before the host runs
## out of pids (kernel.pid_max)
DENSITY ?= 2500
density: build
	SPACE_BIN_DIR=$(BIN) $(GO) run ./cmd/space-density -sandboxes $(DENSITY)

## churn: 10 minutes of random pause/resume/migrate of 20 sandboxes on 3 workers under client load
churn: build
	SPACE_BIN_DIR=$(BIN) SPACE_CHURN_DURATION=10m $(GO) test -run TestChurn -count=1 -timeout 30m -v ./internal/up/

## crash: the long crash-point pass (make test runs a short one): space up
## killed at every point of internal/crashpoint, twice, the second round at
## random places in archives, and a space-node alone killed at every
## worker-side point; the invariants must hold with 0 violations
crash: build
	SPACE_BIN_DIR=$(BIN) SPACE_CRASH_LONG=1 $(GO) test -run 'TestCrashPoints|TestWorkerCrashPoints' -count=1 -timeout 90m -v ./test/crash/

## fuzz: a short run of every fuzz target in the module (FUZZTIME each)
FUZZTIME ?= 10s
fuzz:
	@set -e; for pkg in $$($(GO) list ./...); do \
	  for f in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz' || true); do \
	    echo "== $$pkg $$f"; $(GO) test -run '^$$' -fuzz="^$$f$$" -fuzztime=$(FUZZTIME) $$pkg; \
	  done; done

## check: vet, staticcheck, gofmt and go.mod tidiness
check:
	$(GO) vet ./...
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo 'gofmt: files above need formatting'; exit 1; }
	@cp go.mod /tmp/space-go.mod.bak; cp go.sum /tmp/space-go.sum.bak; $(GO) mod tidy; \
	  if ! diff -q go.mod /tmp/space-go.mod.bak >/dev/null || ! diff -q go.sum /tmp/space-go.sum.bak >/dev/null; then \
	    cp /tmp/space-go.mod.bak go.mod; cp /tmp/space-go.sum.bak go.sum; echo 'go.mod/go.sum are not tidy: run go mod tidy'; exit 1; fi

clean:
	rm -rf $(BIN)

## dashboard: the web dashboard's bundle (web/dashboard -> internal/dashboard/assets,
## embedded in the control plane): npm packages pinned by web/dashboard's lock
## file, built with esbuild. Commit the bundle after: internal/dashboard's test
## fails when it is older than its sources. dashboard-deps: what test/dashboard
## drives it with, Debian's chromium (headless).
.PHONY: dashboard dashboard-deps
dashboard: deps web/dashboard/node_modules/.package-lock.json
	node web/dashboard/build.mjs
web/dashboard/node_modules/.package-lock.json: web/dashboard/package.json web/dashboard/package-lock.json
	npm ci --prefix web/dashboard --no-audit --no-fund --loglevel=error
dashboard-deps:
	@command -v chromium >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core; }
test: dashboard-deps

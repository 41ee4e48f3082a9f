// Package controlplane is space-api: the E2B-compatible REST API, SPACE's
// /space/v1 extensions, the capability signer, placement and the sandbox
// lifecycle. State lives in etcd through package store.
//
// Where things are:
//
//   - routes.go: the one route table (every endpoint is registered there);
//     auth.go authenticates API keys and access tokens (roles, X-Team-ID),
//     decode.go parses request bodies, and
//     errors.go holds the one function that turns an error's errdefs class
//     into an HTTP status and message.
//   - handlers.go, sandboxes.go, list.go, metrics.go, network.go: E2B's
//     sandbox calls (create, get, list, kill, timeout, metrics, network).
//   - lifecycle.go: the sandbox record's state machine and the operation
//     bookkeeping every lifecycle operation shares; one file per operation:
//     pause.go, resume.go (resume and connect), move.go (migrate, and a
//     resume elsewhere), snapshot.go, fork.go.
//   - nodeclient.go: every call the control plane makes to a worker's
//     node-api; placement.go chooses and finds workers.
//   - teams.go, apikeys.go, accesstokens.go: teams, members, API keys and
//     access tokens (docs/API.md); openapi.go serves api/openapi's document,
//     which openapi*_test.go hold the routes, handlers and types to.
//   - capabilities.go: capability requests; keys.go and rotate.go: the
//     signing key every replica shares through the store and its
//     cluster-wide rotation; inspect.go: the /space/v1 reads.
//   - reaper.go: the loop that acts on timeouts and stuck records;
//     leader.go runs it (and every other singleton) only on the replica
//     that leads the control-plane election.
package controlplane

// Package openapi holds the OpenAPI 3 document of the control plane's REST
// API (openapi.yaml), the contract its handlers, the E2B-compatible types
// in api/e2bapi and the SDKs are checked against (internal/controlplane's
// openapi tests). The control plane serves it at /openapi.yaml and
// /openapi.json.
package openapi

import _ "embed"

// YAML is the document as checked in.
//
//go:embed openapi.yaml
var YAML []byte

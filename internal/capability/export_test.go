package capability

import (
	"encoding/json"
	"testing"

	"aidanwoods.dev/go-paseto"
)

// signRaw signs c without Issue's checks, to forge tokens a buggy or
// hostile key holder could produce.
func signRaw(t testing.TB, s *Signer, c Claims) string {
	t.Helper()
	body, _ := json.Marshal(c)
	f, _ := json.Marshal(footer{KID: s.kid})
	tok, err := paseto.NewTokenFromClaimsJSON(body, f)
	if err != nil {
		t.Fatal(err)
	}
	return tok.V4Sign(s.key, implicitAssertion)
}

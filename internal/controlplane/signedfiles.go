package controlplane

import (
	"crypto/subtle"
	"fmt"
	"net/http"
	"strings"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
)

// signatureLen is the length of "v1_" + unpadded base64 of a SHA-256.
const signatureLen = 3 + 43

// handleSignedFilesSandbox tells the edge which sandbox a signed /files URL
// was signed for when the URL names none: the e2b SDK builds uploadUrl and
// downloadUrl on E2B_SANDBOX_URL when it is set, and that URL carries no
// sandbox id. The signature is keyed by one sandbox's access token, so the
// sandbox whose token reproduces it is the one; the edge then asks for the
// capability as for any signed URL (which checks the expiration). Only the
// edge asks; an answer costs one hash per live secure sandbox.
func (s *Server) handleSignedFilesSandbox(w http.ResponseWriter, r *http.Request) {
	c, err := s.authenticate(r.Context(), r.Header.Get(spacev1.HeaderAPIKey))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if !c.edge() {
		s.writeError(w, r, fmt.Errorf("%w: only the edge resolves signed URLs", errdefs.ErrDenied))
		return
	}
	sig := signatureFromQuery(r.URL.Query())
	if sig == nil || len(sig.Signature) != signatureLen || !strings.HasPrefix(sig.Signature, "v1_") ||
		(sig.Operation != "read" && sig.Operation != "write") {
		s.writeError(w, r, errdefs.Message(errdefs.ErrUnauthenticated, "invalid signature"))
		return
	}
	entries, err := s.st.ListSandboxes(r.Context())
	if err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	}
	// Every candidate is hashed and compared, so the time taken does not
	// tell where (or whether) a match is.
	found := ""
	for _, e := range entries {
		rec := e.Record
		if rec.AccessToken == "" || rec.State.Terminal() {
			continue
		}
		want := expectedFileSignature(sig.Path, sig.Operation, sig.Username, rec.AccessToken, sig.Expiration)
		if subtle.ConstantTimeCompare([]byte(want), []byte(sig.Signature)) == 1 {
			found = rec.ID
		}
	}
	if found == "" {
		s.writeError(w, r, errdefs.Message(errdefs.ErrUnauthenticated, "invalid signature"))
		return
	}
	writeJSON(w, http.StatusOK, spacev1.SignedFilesSandbox{SandboxID: found})
}

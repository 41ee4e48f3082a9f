package capability

import (
	"bytes"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"strings"
)

// publicHeader is the PASETO v4.public header.
const publicHeader = "v4.public."

// parsedToken is a v4.public token split into its signed parts. Parsing
// is done here rather than by the PASETO library on the verify path: the
// library decodes the claims into a map and re-encodes them, which costs
// more than half of an Ed25519 verification again. Signing still uses the
// library, and the tests check both directions against it.
type parsedToken struct {
	message   []byte // the claims JSON
	signature []byte
	footer    []byte
	kid       string
}

var b64 = base64.RawURLEncoding

func parseToken(token string) (parsedToken, error) {
	if len(token) > MaxTokenSize {
		return parsedToken{}, fmt.Errorf("%w: token longer than %d bytes", ErrMalformed, MaxTokenSize)
	}
	rest, ok := strings.CutPrefix(token, publicHeader)
	if !ok {
		return parsedToken{}, fmt.Errorf("%w: not a v4.public token", ErrMalformed)
	}
	body, foot, ok := strings.Cut(rest, ".")
	if !ok || strings.Contains(foot, ".") {
		return parsedToken{}, fmt.Errorf("%w: token must carry exactly one footer", ErrMalformed)
	}
	raw, err := b64.DecodeString(body)
	if err != nil || len(raw) < ed25519.SignatureSize {
		return parsedToken{}, fmt.Errorf("%w: payload encoding", ErrMalformed)
	}
	f, err := b64.DecodeString(foot)
	if err != nil {
		return parsedToken{}, fmt.Errorf("%w: footer encoding", ErrMalformed)
	}
	var ft footer
	if err := json.Unmarshal(f, &ft); err != nil || ft.KID == "" {
		return parsedToken{}, fmt.Errorf("%w: footer carries no key id", ErrMalformed)
	}
	n := len(raw) - ed25519.SignatureSize
	return parsedToken{message: raw[:n], signature: raw[n:], footer: f, kid: ft.KID}, nil
}

// pae is PASETO's pre-authentication encoding of the signed pieces.
func pae(pieces ...[]byte) []byte {
	size := 8
	for _, p := range pieces {
		size += 8 + len(p)
	}
	buf := bytes.NewBuffer(make([]byte, 0, size))
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(pieces)))
	buf.Write(n[:])
	for _, p := range pieces {
		binary.LittleEndian.PutUint64(n[:], uint64(len(p)))
		buf.Write(n[:])
		buf.Write(p)
	}
	return buf.Bytes()
}

// verifyParsed checks the Ed25519 signature of t under pub.
func verifyParsed(t parsedToken, pub ed25519.PublicKey) bool {
	return ed25519.Verify(pub, pae([]byte(publicHeader), t.message, t.footer, implicitAssertion), t.signature)
}

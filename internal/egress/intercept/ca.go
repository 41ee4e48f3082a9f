// Package intercept terminates a sandbox's TLS connection with a leaf
// certificate minted from that sandbox's own CA, so the egress proxy can
// apply E2B network.rules header transforms (secrets the platform
// substitutes) to each HTTP/1.1 request before re-encrypting it toward the
// real server, which is verified as any client would verify it.
//
// The CA is per sandbox so a CA key that leaks out of one sandbox's trust
// store lets nobody impersonate servers to another sandbox; it may only sign
// leaves (MaxPathLen 0) and the leaves live a day.
package intercept

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net/netip"
	"strings"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

const (
	// backdate covers a sandbox clock slightly behind the host's.
	backdate     = time.Hour
	caYears      = 10
	leafValidity = 24 * time.Hour
	// leafRenew: a cached leaf with less than this left is minted again,
	// so a leaf handed out never expires during a long connection's first
	// half day.
	leafRenew = 12 * time.Hour
	// leafCacheSize bounds the leaves kept per sandbox: a sandbox naming
	// endless hosts costs CPU for minting, never memory.
	leafCacheSize = 256
)

// NewCA makes a per-sandbox CA: ECDSA P-256, CA:true, MaxPathLen 0, key
// usage CertSign only, valid from an hour ago for 10 years, subject CN
// "SPACE egress CA <sandboxID>". The key is PEM "EC PRIVATE KEY".
func NewCA(sandboxID string) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("intercept: ca key: %w", err)
	}
	serial, err := randSerial()
	if err != nil {
		return nil, nil, err
	}
	from := time.Now().Add(-backdate)
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "SPACE egress CA " + sandboxID},
		NotBefore:             from,
		NotAfter:              from.AddDate(caYears, 0, 0),
		IsCA:                  true,
		BasicConstraintsValid: true,
		MaxPathLen:            0,
		MaxPathLenZero:        true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, fmt.Errorf("intercept: ca certificate for %q: %w: %v", sandboxID, errdefs.ErrInvalid, err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("intercept: ca key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), nil
}

func randSerial() (*big.Int, error) {
	s, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("intercept: serial: %w", err)
	}
	return s.Add(s, big.NewInt(1)), nil // never 0
}

// parseCA checks that the pair is a CA that may sign leaves and that the
// key is the certificate's.
func parseCA(certPEM, keyPEM []byte) (*x509.Certificate, crypto.Signer, error) {
	cb, _ := pem.Decode(certPEM)
	if cb == nil || cb.Type != "CERTIFICATE" {
		return nil, nil, fmt.Errorf("intercept: ca certificate: %w: no CERTIFICATE block", errdefs.ErrInvalid)
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("intercept: ca certificate: %w: %v", errdefs.ErrInvalid, err)
	}
	if !cert.IsCA || !cert.BasicConstraintsValid || cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, nil, fmt.Errorf("intercept: ca certificate %q is not a CA that may sign: %w", cert.Subject.CommonName, errdefs.ErrInvalid)
	}
	kb, _ := pem.Decode(keyPEM)
	if kb == nil {
		return nil, nil, fmt.Errorf("intercept: ca key: %w: no PEM block", errdefs.ErrInvalid)
	}
	var key any
	switch kb.Type {
	case "EC PRIVATE KEY":
		key, err = x509.ParseECPrivateKey(kb.Bytes)
	case "PRIVATE KEY":
		key, err = x509.ParsePKCS8PrivateKey(kb.Bytes)
	default:
		err = fmt.Errorf("PEM type %q", kb.Type)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("intercept: ca key: %w: %v", errdefs.ErrInvalid, err)
	}
	signer, ok := key.(crypto.Signer)
	if !ok {
		return nil, nil, fmt.Errorf("intercept: ca key: %w: %T cannot sign", errdefs.ErrInvalid, key)
	}
	pub, ok := signer.Public().(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(cert.PublicKey) {
		return nil, nil, fmt.Errorf("intercept: ca key does not match the certificate: %w", errdefs.ErrInvalid)
	}
	return cert, signer, nil
}

// mintLeaf makes a day-long ECDSA server certificate for host (a DNS name
// or an IP literal, already normalized) signed by the CA.
func mintLeaf(ca *x509.Certificate, caKey crypto.Signer, host string, now time.Time) (*tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("intercept: leaf key: %w", err)
	}
	serial, err := randSerial()
	if err != nil {
		return nil, err
	}
	from := now.Add(-backdate)
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: host},
		NotBefore:             from,
		NotAfter:              from.Add(leafValidity),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		tmpl.IPAddresses = append(tmpl.IPAddresses, ip.AsSlice())
	} else {
		tmpl.DNSNames = []string{host}
	}
	if tmpl.NotAfter.After(ca.NotAfter) {
		tmpl.NotAfter = ca.NotAfter
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("intercept: leaf for %q: %w", host, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("intercept: leaf for %q: %w", host, err)
	}
	return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}

// normHost lower-cases host and drops a trailing dot; it must then be an
// IP literal or a DNS name (labels of letters, digits, '-' and '_'), so
// nothing odd ends up in a certificate or is compared against a Host.
func normHost(host string) (string, error) {
	h := strings.TrimSuffix(strings.ToLower(host), ".")
	if ip, err := netip.ParseAddr(h); err == nil {
		if ip.Zone() != "" {
			return "", fmt.Errorf("intercept: host %q: %w: zoned address", host, errdefs.ErrInvalid)
		}
		return ip.Unmap().String(), nil
	}
	if h == "" || len(h) > 253 {
		return "", fmt.Errorf("intercept: host %q: %w: bad length", host, errdefs.ErrInvalid)
	}
	for _, label := range strings.Split(h, ".") {
		if label == "" || len(label) > 63 {
			return "", fmt.Errorf("intercept: host %q: %w: bad label", host, errdefs.ErrInvalid)
		}
		for _, c := range []byte(label) {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return "", fmt.Errorf("intercept: host %q: %w: bad character", host, errdefs.ErrInvalid)
			}
		}
	}
	return h, nil
}

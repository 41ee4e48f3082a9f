// Package edgecert holds the certificates space-edge serves the direct
// sandbox URLs https://<port>-<sandbox>.<domain> with: the operator's
// certificate for *.<domain>, or else a local certificate authority that is
// made once under a directory (ECDSA P-256, name-constrained to the domain,
// no IP addresses) and signs short-lived leaves in memory.
//
// The local CA signs one leaf per server name rather than only a wildcard:
// browsers, OpenSSL (curl) and Node refuse a wildcard one label below a
// top-level name ("*.localhost"), and localhost is the one domain that
// resolves on any machine without DNS. Each leaf also names *.<domain> and
// <domain>. Leaves are renewed in memory before they expire; the CA is
// replaced at start when it nears its end or names another domain (clients
// then trust the new one: Certs.CACreated says so).
package edgecert

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/spacesbx/space/internal/atomicfile"
	"github.com/spacesbx/space/internal/errdefs"
)

// File names of the local CA in Config.Dir.
const (
	CAFileName    = "ca.pem"
	CAKeyFileName = "ca-key.pem"
)

// Lifetimes. A leaf is renewed LeafRenewBefore its end, the CA (at start)
// CARenewBefore its end.
const (
	CALifetime      = 5 * 365 * 24 * time.Hour
	CARenewBefore   = 30 * 24 * time.Hour
	LeafLifetime    = 30 * 24 * time.Hour
	LeafRenewBefore = 10 * 24 * time.Hour
	// backdate tolerates clients whose clock is a little behind.
	backdate = time.Hour
	// maxLeaves bounds the leaves kept; a client sending endless names
	// costs a signature each, never memory.
	maxLeaves = 4096
	// operatorRecheck is how often the operator's files are checked for
	// a renewed certificate.
	operatorRecheck = time.Minute
)

// Config configures Certs.
type Config struct {
	// Domain is the sandbox domain, a bare DNS name (required).
	Domain string
	// CertFile and KeyFile are the operator's PEM certificate (chain) and
	// key for *.<Domain>; both or neither. A renewed pair in the same
	// files is picked up within a minute.
	CertFile, KeyFile string
	// Dir holds the local CA (CAFileName, CAKeyFileName; created if
	// missing) when no operator certificate is given.
	Dir string
	// Clock is the time source. Default time.Now.
	Clock func() time.Time
	// Logger receives the CA's creation and renewals. Default
	// slog.Default().
	Logger *slog.Logger
}

// Validate reports configuration errors.
func (c Config) Validate() error {
	var errs []error
	if err := checkDomain(c.Domain); err != nil {
		errs = append(errs, err)
	}
	if (c.CertFile == "") != (c.KeyFile == "") {
		errs = append(errs, fmt.Errorf("edgecert: %w: the certificate and its key go together (got cert %q, key %q)", errdefs.ErrInvalid, c.CertFile, c.KeyFile))
	}
	if c.CertFile == "" && c.Dir == "" {
		errs = append(errs, fmt.Errorf("edgecert: %w: Dir (the local CA's directory) is required without an operator certificate", errdefs.ErrInvalid))
	}
	return errors.Join(errs...)
}

// Certs answers TLS handshakes for the sandbox domain. Safe for concurrent
// use.
type Certs struct {
	cfg    Config
	domain string
	log    *slog.Logger

	// local CA
	ca        *x509.Certificate
	caKey     crypto.Signer
	leafKey   *ecdsa.PrivateKey
	caCreated bool

	mu     sync.Mutex
	leaves *simplelru.LRU[string, *tls.Certificate]
	// operator's certificate and when its files were last looked at
	op        *tls.Certificate
	opChecked time.Time
	opMod     [2]time.Time
}

// New loads the operator's certificate, or loads (creating or renewing
// it when needed) the local CA under cfg.Dir.
func New(cfg Config) (*Certs, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	c := &Certs{cfg: cfg, domain: normName(cfg.Domain), log: cfg.Logger.With("component", "edgecert")}
	c.leaves, _ = simplelru.NewLRU[string, *tls.Certificate](maxLeaves, nil)
	if cfg.CertFile != "" {
		op, mod, err := c.loadOperator()
		if err != nil {
			return nil, err
		}
		c.op, c.opMod, c.opChecked = op, mod, cfg.Clock()
		return c, nil
	}
	if err := c.loadCA(); err != nil {
		return nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("edgecert: leaf key: %w", err)
	}
	c.leafKey = key
	return c, nil
}

// CAFile is the local CA's certificate clients trust (NODE_EXTRA_CA_CERTS,
// curl --cacert, the system store), or "" with an operator certificate.
func (c *Certs) CAFile() string {
	if c.ca == nil {
		return ""
	}
	return filepath.Join(c.cfg.Dir, CAFileName)
}

// CACreated reports whether New made the local CA (first start, or a
// renewal): clients must trust the new one.
func (c *Certs) CACreated() bool { return c.caCreated }

// TLSConfig is the server configuration for the edge's HTTPS listener.
// HTTP/1.1 only: the edge's process streams and upgrades (WebSocket, raw
// TCP) are HTTP/1.1, as on its plain listener.
func (c *Certs) TLSConfig() *tls.Config {
	return &tls.Config{
		MinVersion:     tls.VersionTLS12,
		NextProtos:     []string{"http/1.1"},
		GetCertificate: c.GetCertificate,
	}
}

// GetCertificate returns the certificate for the handshake's server name:
// the operator's, or a local leaf for <label>.<domain> or <domain> (and
// for a client that sends no name). Any other name fails the handshake.
func (c *Certs) GetCertificate(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
	now := c.cfg.Clock()
	if c.cfg.CertFile != "" {
		return c.operator(now), nil
	}
	name := normName(hello.ServerName)
	if name != "" && name != c.domain {
		if err := c.checkName(name); err != nil {
			return nil, err
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if l, ok := c.leaves.Get(name); ok && now.Before(l.Leaf.NotAfter.Add(-LeafRenewBefore)) {
		return l, nil
	}
	l, err := c.mintLeaf(name, now)
	if err != nil {
		return nil, err
	}
	c.leaves.Add(name, l)
	return l, nil
}

// checkName accepts exactly one DNS label (letters, digits, '-') below the
// domain: the form of <port>-<sandbox>.<domain>.
func (c *Certs) checkName(name string) error {
	label, ok := strings.CutSuffix(name, "."+c.domain)
	if !ok || !isLabel(label) {
		return fmt.Errorf("edgecert: %w: no certificate for %q: names are <port>-<sandbox>.%s", errdefs.ErrNotFound, name, c.domain)
	}
	return nil
}

func isLabel(s string) bool {
	if s == "" || len(s) > 63 || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for i := 0; i < len(s); i++ {
		if b := s[i]; !(b >= 'a' && b <= 'z' || b >= '0' && b <= '9' || b == '-') {
			return false
		}
	}
	return true
}

func normName(s string) string { return strings.ToLower(strings.TrimSuffix(s, ".")) }

// checkDomain accepts a bare DNS name: labels of letters, digits and '-'.
func checkDomain(d string) error {
	n := normName(d)
	if n == "" || len(n) > 200 {
		return fmt.Errorf("edgecert: %w: domain %q: want a DNS name", errdefs.ErrInvalid, d)
	}
	for _, l := range strings.Split(n, ".") {
		if !isLabel(l) {
			return fmt.Errorf("edgecert: %w: domain %q: want a DNS name (no port, scheme or wildcard)", errdefs.ErrInvalid, d)
		}
	}
	return nil
}

// loadCA uses the CA in Dir when it is one this package made for the
// domain and not near its end; otherwise it makes a new one.
func (c *Certs) loadCA() error {
	certPath, keyPath := filepath.Join(c.cfg.Dir, CAFileName), filepath.Join(c.cfg.Dir, CAKeyFileName)
	cp, cerr := os.ReadFile(certPath)
	kp, kerr := os.ReadFile(keyPath)
	now := c.cfg.Clock()
	if cerr == nil && kerr == nil {
		ca, key, err := parsePair(cp, kp)
		switch {
		case err != nil:
			c.log.Warn("local CA unusable: making a new one", "dir", c.cfg.Dir, "err", err)
		case !slices.Equal(ca.PermittedDNSDomains, []string{c.domain}):
			c.log.Warn("local CA is for another domain: making a new one", "dir", c.cfg.Dir, "domain", c.domain, "was", ca.PermittedDNSDomains)
		case !now.Before(ca.NotAfter.Add(-CARenewBefore)):
			c.log.Warn("local CA near its end: making a new one", "dir", c.cfg.Dir, "not_after", ca.NotAfter)
		default:
			c.ca, c.caKey = ca, key
			return nil
		}
	} else if !errors.Is(cerr, os.ErrNotExist) && cerr != nil || !errors.Is(kerr, os.ErrNotExist) && kerr != nil {
		return fmt.Errorf("edgecert: local CA in %s: %w", c.cfg.Dir, errors.Join(cerr, kerr))
	}
	if err := os.MkdirAll(c.cfg.Dir, 0o700); err != nil {
		return fmt.Errorf("edgecert: %w", err)
	}
	certPEM, keyPEM, err := newCA(c.domain, now)
	if err != nil {
		return err
	}
	// The key first: a crash in between leaves a key without its
	// certificate, which the next start replaces.
	if err := atomicfile.Write(keyPath, keyPEM, 0o600); err != nil {
		return fmt.Errorf("edgecert: %w", err)
	}
	if err := atomicfile.Write(certPath, certPEM, 0o644); err != nil {
		return fmt.Errorf("edgecert: %w", err)
	}
	ca, key, err := parsePair(certPEM, keyPEM)
	if err != nil {
		return err
	}
	c.ca, c.caKey, c.caCreated = ca, key, true
	c.log.Info("made the local CA for the sandbox domain", "cert", certPath, "domain", c.domain, "not_after", ca.NotAfter)
	return nil
}

// newCA makes a CA for domain: ECDSA P-256, may sign only end-entity
// certificates (path length 0) for domain and its subdomains, and none
// for IP addresses.
func newCA(domain string, now time.Time) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("edgecert: ca key: %w", err)
	}
	serial, err := randSerial()
	if err != nil {
		return nil, nil, err
	}
	from := now.Add(-backdate)
	_, all4, _ := net.ParseCIDR("0.0.0.0/0")
	_, all6, _ := net.ParseCIDR("::/0")
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		// The serial in the name tells CAs of successive starts apart in
		// a trust store.
		Subject:                     pkix.Name{CommonName: fmt.Sprintf("SPACE local CA %s %x", domain, serial.Bytes()[:4]), Organization: []string{"SPACE"}},
		NotBefore:                   from,
		NotAfter:                    from.Add(CALifetime),
		IsCA:                        true,
		BasicConstraintsValid:       true,
		MaxPathLenZero:              true,
		KeyUsage:                    x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		PermittedDNSDomainsCritical: true,
		PermittedDNSDomains:         []string{domain},
		ExcludedIPRanges:            []*net.IPNet{all4, all6},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, fmt.Errorf("edgecert: ca certificate: %w", err)
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("edgecert: ca key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), nil
}

// parsePair checks that the pair is a CA that may sign and that the key
// is the certificate's.
func parsePair(certPEM, keyPEM []byte) (*x509.Certificate, crypto.Signer, error) {
	cb, _ := pem.Decode(certPEM)
	if cb == nil || cb.Type != "CERTIFICATE" {
		return nil, nil, fmt.Errorf("edgecert: ca certificate: %w: no CERTIFICATE block", errdefs.ErrInvalid)
	}
	ca, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("edgecert: ca certificate: %w: %v", errdefs.ErrInvalid, err)
	}
	if !ca.IsCA || ca.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, nil, fmt.Errorf("edgecert: ca certificate: %w: not a CA that may sign", errdefs.ErrInvalid)
	}
	kb, _ := pem.Decode(keyPEM)
	if kb == nil || kb.Type != "PRIVATE KEY" {
		return nil, nil, fmt.Errorf("edgecert: ca key: %w: no PRIVATE KEY block", errdefs.ErrInvalid)
	}
	k, err := x509.ParsePKCS8PrivateKey(kb.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("edgecert: ca key: %w: %v", errdefs.ErrInvalid, err)
	}
	key, ok := k.(*ecdsa.PrivateKey)
	if !ok || !key.PublicKey.Equal(ca.PublicKey) {
		return nil, nil, fmt.Errorf("edgecert: ca key: %w: not the certificate's ECDSA key", errdefs.ErrInvalid)
	}
	return ca, key, nil
}

func randSerial() (*big.Int, error) {
	s, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("edgecert: serial: %w", err)
	}
	return s.Add(s, big.NewInt(1<<32)), nil // never 0, at least 4 bytes
}

// mintLeaf signs a server certificate for name ("" or the domain: the
// domain's own) that also names *.<domain> and <domain>. Callers hold mu.
func (c *Certs) mintLeaf(name string, now time.Time) (*tls.Certificate, error) {
	serial, err := randSerial()
	if err != nil {
		return nil, err
	}
	dns := []string{c.domain, "*." + c.domain}
	cn := c.domain
	if name != "" && name != c.domain {
		dns, cn = append([]string{name}, dns...), name
	}
	from := now.Add(-backdate)
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: cn},
		DNSNames:              dns,
		NotBefore:             from,
		NotAfter:              from.Add(LeafLifetime),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
	}
	if tmpl.NotAfter.After(c.ca.NotAfter) {
		tmpl.NotAfter = c.ca.NotAfter
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.ca, &c.leafKey.PublicKey, c.caKey)
	if err != nil {
		return nil, fmt.Errorf("edgecert: leaf for %q: %w", name, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("edgecert: leaf for %q: %w", name, err)
	}
	return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: c.leafKey, Leaf: leaf}, nil
}

// loadOperator reads the operator's pair and checks it: the key is the
// certificate's, it names *.<domain> (any <label>.<domain>) and it has not
// expired.
func (c *Certs) loadOperator() (*tls.Certificate, [2]time.Time, error) {
	var mod [2]time.Time
	for i, p := range []string{c.cfg.CertFile, c.cfg.KeyFile} {
		fi, err := os.Stat(p)
		if err != nil {
			return nil, mod, fmt.Errorf("edgecert: operator certificate: %w", err)
		}
		mod[i] = fi.ModTime()
	}
	pair, err := tls.LoadX509KeyPair(c.cfg.CertFile, c.cfg.KeyFile)
	if err != nil {
		return nil, mod, fmt.Errorf("edgecert: operator certificate: %w: %v", errdefs.ErrInvalid, err)
	}
	leaf := pair.Leaf
	if leaf == nil {
		if leaf, err = x509.ParseCertificate(pair.Certificate[0]); err != nil {
			return nil, mod, fmt.Errorf("edgecert: operator certificate: %w: %v", errdefs.ErrInvalid, err)
		}
		pair.Leaf = leaf
	}
	if err := leaf.VerifyHostname("8000-probe." + c.domain); err != nil {
		return nil, mod, fmt.Errorf("edgecert: operator certificate %s: %w: it does not cover *.%s (names %v)", c.cfg.CertFile, errdefs.ErrInvalid, c.domain, leaf.DNSNames)
	}
	if now := c.cfg.Clock(); !now.Before(leaf.NotAfter) {
		return nil, mod, fmt.Errorf("edgecert: operator certificate %s: %w: expired at %s", c.cfg.CertFile, errdefs.ErrInvalid, leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	return &pair, mod, nil
}

// operator returns the operator's certificate, reloading it when its
// files changed (a renewal); a pair that fails the checks is logged and
// the one in use kept.
func (c *Certs) operator(now time.Time) *tls.Certificate {
	c.mu.Lock()
	defer c.mu.Unlock()
	if now.Sub(c.opChecked) < operatorRecheck {
		return c.op
	}
	c.opChecked = now
	var mod [2]time.Time
	for i, p := range []string{c.cfg.CertFile, c.cfg.KeyFile} {
		if fi, err := os.Stat(p); err == nil {
			mod[i] = fi.ModTime()
		}
	}
	if mod == c.opMod {
		return c.op
	}
	op, mod, err := c.loadOperator()
	if err != nil {
		c.log.Error("renewed operator certificate refused: keeping the one in use", "err", err)
		c.opMod = mod
		return c.op
	}
	c.op, c.opMod = op, mod
	c.log.Info("operator certificate reloaded", "cert", c.cfg.CertFile, "not_after", op.Leaf.NotAfter)
	return c.op
}

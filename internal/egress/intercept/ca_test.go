package intercept

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

func parsePEMCert(t *testing.T, b []byte) *x509.Certificate {
	t.Helper()
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "CERTIFICATE" {
		t.Fatalf("not a CERTIFICATE PEM: %q", b)
	}
	c, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestNewCA(t *testing.T) {
	before := time.Now()
	certPEM, keyPEM, err := NewCA("sbx-42")
	if err != nil {
		t.Fatal(err)
	}
	c := parsePEMCert(t, certPEM)
	if !c.IsCA || !c.BasicConstraintsValid {
		t.Error("not a CA")
	}
	if c.MaxPathLen != 0 || !c.MaxPathLenZero {
		t.Errorf("MaxPathLen %d zero %v: the CA may only sign leaves", c.MaxPathLen, c.MaxPathLenZero)
	}
	if c.KeyUsage != x509.KeyUsageCertSign {
		t.Errorf("key usage %b, want CertSign only", c.KeyUsage)
	}
	if c.Subject.CommonName != "SPACE egress CA sbx-42" {
		t.Errorf("CN %q", c.Subject.CommonName)
	}
	pub, ok := c.PublicKey.(*ecdsa.PublicKey)
	if !ok || pub.Curve != elliptic.P256() {
		t.Errorf("key %T, want ECDSA P-256", c.PublicKey)
	}
	if nb := before.Add(-backdate); c.NotBefore.After(nb) || c.NotBefore.Before(nb.Add(-time.Minute)) {
		t.Errorf("NotBefore %v, want about %v", c.NotBefore, nb)
	}
	if c.NotAfter.Sub(c.NotBefore) < 10*365*24*time.Hour || c.NotAfter.Sub(c.NotBefore) > 10*366*24*time.Hour {
		t.Errorf("validity %v, want 10 years", c.NotAfter.Sub(c.NotBefore))
	}
	if err := c.CheckSignatureFrom(c); err != nil {
		t.Errorf("not self-signed: %v", err)
	}
	kb, _ := pem.Decode(keyPEM)
	if kb == nil || kb.Type != "EC PRIVATE KEY" {
		t.Fatalf("key PEM %q", keyPEM)
	}
	k, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil || !k.PublicKey.Equal(c.PublicKey) {
		t.Fatalf("key does not match: %v", err)
	}
	c2, _, _ := NewCA("sbx-42")
	if parsePEMCert(t, c2).SerialNumber.Cmp(c.SerialNumber) == 0 {
		t.Error("two CAs share a serial")
	}
}

func TestNewAcceptsPKCS8AndRejectsBadPairs(t *testing.T) {
	certPEM, keyPEM, err := NewCA("a")
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := pem.Decode(keyPEM)
	k, _ := x509.ParseECPrivateKey(kb.Bytes)
	p8, _ := x509.MarshalPKCS8PrivateKey(k)
	if _, err := New(certPEM, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: p8}), nil); err != nil {
		t.Fatalf("PKCS#8 key: %v", err)
	}
	otherCert, otherKey, _ := NewCA("b")
	leafCA, _ := New(certPEM, keyPEM, nil)
	leaf, err := leafCA.leaf("example.com")
	if err != nil {
		t.Fatal(err)
	}
	leafPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: leaf.Certificate[0]})
	leafKey, _ := x509.MarshalPKCS8PrivateKey(leaf.PrivateKey)
	for name, tc := range map[string][2][]byte{
		"mismatched key": {certPEM, otherKey},
		"other cert":     {otherCert, keyPEM},
		"leaf as CA":     {leafPEM, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: leafKey})},
		"garbage cert":   {[]byte("not pem"), keyPEM},
		"garbage key":    {certPEM, []byte("-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n")},
		"wrong key type": {certPEM, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: kb.Bytes})},
		"key as cert":    {keyPEM, keyPEM},
		"empty":          {nil, nil},
	} {
		if _, err := New(tc[0], tc[1], nil); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: %v, want invalid", name, err)
		}
	}
}

func TestLeaf(t *testing.T) {
	certPEM, keyPEM, _ := NewCA("sbx")
	i, err := New(certPEM, keyPEM, nil)
	if err != nil {
		t.Fatal(err)
	}
	roots := poolOf(t, certPEM)
	for _, host := range []string{"api.example.com", "192.0.2.10", "2001:db8::5"} {
		c, err := i.leaf(host)
		if err != nil {
			t.Fatal(err)
		}
		l := c.Leaf
		if _, err := l.Verify(x509.VerifyOptions{DNSName: host, Roots: roots}); err != nil {
			t.Errorf("%s: leaf does not verify: %v", host, err)
		}
		if err := l.VerifyHostname("other.example.com"); err == nil {
			t.Errorf("%s: leaf also valid for another host", host)
		}
		if len(l.DNSNames)+len(l.IPAddresses) != 1 || l.IsCA {
			t.Errorf("%s: SANs %v %v, CA %v", host, l.DNSNames, l.IPAddresses, l.IsCA)
		}
		if l.NotAfter.Sub(l.NotBefore) != leafValidity {
			t.Errorf("%s: validity %v", host, l.NotAfter.Sub(l.NotBefore))
		}
		if _, ok := c.PrivateKey.(*ecdsa.PrivateKey); !ok {
			t.Errorf("%s: key %T", host, c.PrivateKey)
		}
		if again, _ := i.leaf(host); again != c {
			t.Errorf("%s: leaf not cached", host)
		}
	}
}

func TestLeafCacheBoundedAndRenewed(t *testing.T) {
	certPEM, keyPEM, _ := NewCA("sbx")
	i, err := New(certPEM, keyPEM, nil)
	if err != nil {
		t.Fatal(err)
	}
	first, _ := i.leaf("h0.example")
	for n := range leafCacheSize + 44 {
		if _, err := i.leaf(fmt.Sprintf("h%d.example", n)); err != nil {
			t.Fatal(err)
		}
	}
	if i.leaves.Len() != leafCacheSize {
		t.Fatalf("cache holds %d leaves, bound %d", i.leaves.Len(), leafCacheSize)
	}
	if again, _ := i.leaf("h0.example"); again == first {
		t.Fatal("the oldest leaf was not evicted")
	}

	// A leaf close to its end is minted again.
	old, _ := i.leaf("old.example")
	stale := *old
	stale.Leaf = new(x509.Certificate)
	*stale.Leaf = *old.Leaf
	stale.Leaf.NotAfter = time.Now().Add(time.Hour)
	i.leaves.Add("old.example", &stale)
	if renewed, _ := i.leaf("old.example"); renewed == &stale || renewed.Leaf.NotAfter.Before(time.Now().Add(leafRenew)) {
		t.Fatal("a leaf with an hour left was served again")
	}
}

func TestNormHost(t *testing.T) {
	for in, want := range map[string]string{
		"Example.COM.":       "example.com",
		"a-b_c.example":      "a-b_c.example",
		"192.0.2.1":          "192.0.2.1",
		"::FFFF:192.0.2.1":   "192.0.2.1",
		"2001:DB8::1":        "2001:db8::1",
		"xn--bcher-kva.test": "xn--bcher-kva.test",
	} {
		if got, err := normHost(in); err != nil || got != want {
			t.Errorf("normHost(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", ".", "a..b", "evil.com/x", "a b", "fe80::1%eth0", "*.example.com",
		"example.com:443", "ex\x00ample", strings.Repeat("a", 64) + ".com", strings.Repeat("a.", 127) + "ab", "bücher.test"} {
		if got, err := normHost(in); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("normHost(%q) = %q, %v; want invalid", in, got, err)
		}
	}
}

func TestServeRejectsBadArguments(t *testing.T) {
	certPEM, keyPEM, _ := NewCA("sbx")
	i, _ := New(certPEM, keyPEM, nil)
	for name, tc := range map[string]struct {
		host    string
		headers map[string]string
	}{
		"bad host":             {"evil.com/x", nil},
		"header name with CR":  {"example.com", map[string]string{"X-A\r\nX-B": "v"}},
		"header name with ':'": {"example.com", map[string]string{"X-A:": "v"}},
		"value with CR LF":     {"example.com", map[string]string{"X-A": "v\r\nX-Evil: 1"}},
		"host header":          {"example.com", map[string]string{"host": "evil.example.net"}},
		"empty name":           {"example.com", map[string]string{"": "v"}},
	} {
		a, b := net.Pipe()
		dialed := false
		err := i.Serve(t.Context(), a, tc.host, tc.headers, func(context.Context) (net.Conn, error) { dialed = true; return nil, errors.New("no") })
		if !errors.Is(err, errdefs.ErrInvalid) || dialed {
			t.Errorf("%s: %v (dialed %v), want invalid", name, err, dialed)
		}
		if _, err := b.Write([]byte{1}); err == nil {
			t.Errorf("%s: client connection left open", name)
		}
		b.Close()
	}
}

func TestLeafConcurrent(t *testing.T) {
	certPEM, keyPEM, _ := NewCA("sbx")
	i, err := New(certPEM, keyPEM, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *tls.Certificate, 16)
	for range 16 {
		go func() {
			c, err := i.leaf("same.example")
			if err != nil {
				t.Error(err)
			}
			for n := range 20 {
				i.leaf(fmt.Sprintf("h%d.example", n))
			}
			got <- c
		}()
	}
	first := <-got
	for range 15 {
		if c := <-got; c != first {
			t.Fatal("one host minted twice")
		}
	}
}

package up

import (
	"bytes"
	"strings"
	"testing"
)

// TestTLSConfigValidate: a certificate the edge would not serve is a
// configuration error, not silently ignored.
func TestTLSConfigValidate(t *testing.T) {
	for _, c := range []Config{{TLSCertFile: "c.pem", TLSKeyFile: "k.pem"}, {TLSCertFile: "c.pem"}} {
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "edge-tls-addr") {
			t.Errorf("%+v: %v", c, err)
		}
	}
	if err := (Config{EdgeTLSAddr: DefaultEdgeTLSAddr, TLSCertFile: "c.pem", TLSKeyFile: "k.pem"}).Validate(); err != nil {
		t.Error(err)
	}
}

// TestDirectURLsBanner: the banner names the direct URLs' domain and, for
// the local CA, the three ways to trust it and the name set-up.
func TestDirectURLsBanner(t *testing.T) {
	var b bytes.Buffer
	printDirectURLs(&b, &Platform{DirectURLs: true, SandboxDomain: "localhost:3443", CAFile: "/d/tls/ca.pem", CACreated: true}, "localhost")
	for _, want := range []string{"https://<port>-<id>.localhost:3443", "export NODE_EXTRA_CA_CERTS=/d/tls/ca.pem",
		"curl --cacert /d/tls/ca.pem", "update-ca-certificates", "made by this start", "libnss-myhostname"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("banner lacks %q:\n%s", want, b.String())
		}
	}
	b.Reset()
	printDirectURLs(&b, &Platform{DirectURLs: true, SandboxDomain: "sbx.example.com"}, "sbx.example.com")
	if s := b.String(); strings.Contains(s, "CA") || !strings.Contains(s, "https://<port>-<id>.sbx.example.com") {
		t.Errorf("operator certificate banner:\n%s", s)
	}
	b.Reset()
	printDirectURLs(&b, &Platform{}, "localhost")
	if b.Len() != 0 {
		t.Errorf("no HTTPS, yet: %s", b.String())
	}
}

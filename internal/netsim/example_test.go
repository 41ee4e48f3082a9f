package netsim_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"

	"github.com/spacesbx/space/internal/netsim"
)

// A test serves "api.example.test" from the first host and fetches it over
// HTTPS, trusting the internet's CA and resolving through its DNS.
func ExampleStart() {
	inet, err := netsim.Start(netsim.Options{})
	if err != nil {
		panic(err) // needs root
	}
	defer inet.Close()
	if err := inet.SetZone("api.example.test", inet.Host(0)); err != nil {
		panic(err)
	}
	resolver := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, inet.DNS().String())
	}}
	client := &http.Client{Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: inet.CAPool()},
		DialContext:     (&net.Dialer{Resolver: resolver}).DialContext,
	}}
	resp, err := client.Get("https://api.example.test/")
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Println(string(body), len(inet.Queries()) > 0, inet.Requests()[0].SNI)
}

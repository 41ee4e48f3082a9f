// Package filesystempbconnect holds the generated Connect client and handler of envd's
// filesystem service.
package filesystempbconnect

// Package processpbconnect holds the generated Connect client and handler of envd's
// process service.
package processpbconnect
